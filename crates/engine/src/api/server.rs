//! The worker's HTTP API (axum): OpenAI chat and completions, `/v1/models`, vLLM's
//! `/tokenize` and `/detokenize`, `/health`,
//! `/metrics`, and `/start_profile` / `/stop_profile` (with `--profile-dir`). Every error
//! body is OpenAI-shaped, including malformed JSON.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{header, StatusCode};
use pdserve_protocol::{unix_now, ApiError, ModelCard, ModelList};
use serde_json::json;

use super::{chat, completions, AppState};
use crate::health::Unhealthy;
use crate::profile::ProfileError;

/// Default largest request body accepted (`--max-body-bytes`; the limit is applied with
/// the other layers in `http_layers`).
pub const MAX_BODY_BYTES: usize = super::http_layers::DEFAULT_MAX_BODY_BYTES;

/// The worker's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/responses", post(super::responses::create))
        .route(
            "/v1/responses/{id}",
            get(super::responses::retrieve).delete(super::responses::delete),
        )
        .route("/v1/models", get(models))
        // vLLM's tokenizer routes.
        .route("/tokenize", post(super::tokenize::tokenize))
        .route("/detokenize", post(super::tokenize::detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/start_profile", post(start_profile))
        .route("/stop_profile", post(stop_profile))
        .route(
            pdserve_protocol::kv::KV_RELEASE_PATH,
            post(super::kv_release::handle),
        )
        // SGLang's native API and what its gateway probes (see `server_info`).
        .route("/generate", post(super::sglang_generate::handle))
        .route("/server_info", get(super::server_info::server_info))
        .route("/get_server_info", get(super::server_info::server_info))
        .route("/model_info", get(super::server_info::model_info))
        .route("/get_model_info", get(super::server_info::model_info))
        .route("/dashboard", get(super::dashboard::page))
        .route("/dashboard/data", get(super::dashboard::data))
        .layer(axum::middleware::from_fn(super::dashboard::record))
        .layer(axum::Extension(super::dashboard::WorkerHistory::shared(
            state.serving.metrics.clone(),
        )))
        .fallback(not_found)
        .with_state(state)
}

async fn models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: app.serving.limits.served_model_name.clone(),
            object: "model".into(),
            created: unix_now(),
            owned_by: "pdserve".into(),
            max_model_len: Some(app.serving.limits.max_model_len as u64),
            extra: Default::default(),
        }],
    })
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    health_response(app.health.check())
}

/// `GET /health`: 200 `{"status": "ok"}` when the worker can serve; otherwise 503 with
/// `{"status": "unavailable", "reason", "message"}` saying why.
pub fn health_response(health: Result<(), Unhealthy>) -> Response {
    match health {
        Ok(()) => Json(json!({"status": "ok"})).into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "unavailable",
                "reason": why.reason(),
                "message": why.to_string(),
            })),
        )
            .into_response(),
    }
}

async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.serving.metrics.encode(),
    )
        .into_response()
}

/// A profiler error as vLLM answers it: 404 when profiling is off (the route does not
/// exist there), 400 for a stop without a start.
fn profile_error(e: ProfileError) -> ApiError {
    match e {
        ProfileError::Disabled => ApiError::new(StatusCode::NOT_FOUND, "not_found", e.to_string()),
        ProfileError::NotRunning => ApiError::bad_request(e.to_string()),
        ProfileError::Io { .. } => ApiError::internal(e.to_string()),
    }
}

/// `POST /start_profile`: starts recording the scheduler's steps.
async fn start_profile(
    State(app): State<Arc<AppState>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let started = app
        .serving
        .engine
        .profiler()
        .start()
        .map_err(profile_error)?;
    tracing::info!(started, "profiler recording");
    Ok(Json(
        json!({"status": if started { "started" } else { "already recording" }}),
    ))
}

/// `POST /stop_profile`: stops recording and writes the Chrome trace.
async fn stop_profile(
    State(app): State<Arc<AppState>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let profiler = app.serving.engine.profiler().clone();
    let trace = tokio::task::spawn_blocking(move || profiler.stop())
        .await
        .map_err(|e| ApiError::internal(format!("profiler task failed: {e}")))?
        .map_err(profile_error)?;
    tracing::info!(path = %trace.path.display(), steps = trace.steps, "profiler trace written");
    Ok(Json(json!({
        "status": "stopped",
        "trace": trace.path,
        "steps": trace.steps,
        "dropped_steps": trace.dropped,
    })))
}

async fn not_found(uri: http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {}", uri.path()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn answer(health: Result<(), Unhealthy>) -> (StatusCode, serde_json::Value) {
        let response = health_response(health);
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn health_is_200_or_503_with_the_reason() {
        let (status, body) = answer(Ok(())).await;
        assert_eq!((status, body), (StatusCode::OK, json!({"status": "ok"})));
        for (why, reason) in [
            (Unhealthy::Draining, "draining"),
            (Unhealthy::SchedulerExited, "scheduler_exited"),
            (
                Unhealthy::SchedulerWedged(Duration::from_secs(31)),
                "scheduler_wedged",
            ),
        ] {
            let message = why.to_string();
            let (status, body) = answer(Err(why)).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(
                body,
                json!({"status": "unavailable", "reason": reason, "message": message})
            );
        }
    }
}
