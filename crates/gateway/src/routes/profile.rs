//! `POST /start_profile` and `POST /stop_profile`: forwarded to one live instance of every
//! role at once, as vLLM's EPD proxy does. A worker without profiling answers 404, which
//! is tolerated (its role reports `null`); when every instance says so, the answer is 503.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use pdserve_protocol::{ApiError, WorkerRole};
use serde_json::{Map, Value};

use crate::clients::worker_client::{Exchange, ForwardHeaders};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::policy::RouteRequest;
use crate::serving::Serving;

/// `POST /start_profile`.
pub async fn start(State(state): State<Arc<Serving>>, headers: HeaderMap, body: Bytes) -> Response {
    fan_out(&state, "start", &headers, body).await
}

/// `POST /stop_profile`.
pub async fn stop(State(state): State<Arc<Serving>>, headers: HeaderMap, body: Bytes) -> Response {
    fan_out(&state, "stop", &headers, body).await
}

/// What one instance answered: its JSON (`{}` for an empty 2xx body), or `None` for 404.
async fn forward(
    state: &Serving,
    worker: &Arc<Worker>,
    path: &str,
    headers: &ForwardHeaders,
    body: Bytes,
) -> Result<Option<Value>, Failure> {
    let url = reqwest::Url::parse(&format!("{}{path}", worker.base))
        .map_err(|e| ApiError::internal(format!("cannot build the profile URL: {e}")))?;
    // Stopping a profiler writes its trace: allow as long as a decode leg.
    let exchange = Exchange::new(worker, "worker", state.settings.decode_timeout);
    let request = state.client.post_json(&url, body, headers);
    match exchange.send_and_read(request).await {
        Ok(answer) => Ok(Some(
            serde_json::from_slice(&answer).unwrap_or_else(|_| Value::Object(Map::new())),
        )),
        Err(e) if e.status == Some(StatusCode::NOT_FOUND) => {
            tracing::warn!(worker = %worker.base, "profiling endpoint missing on {path}");
            Ok(None)
        }
        Err(e) => Err(e.failure),
    }
}

async fn fan_out(state: &Serving, command: &str, headers: &HeaderMap, body: Bytes) -> Response {
    // vLLM's proxy posts a JSON body; an empty one is taken as `{}`.
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        Bytes::from_static(b"{}")
    } else if serde_json::from_slice::<Value>(&body).is_err() {
        return ApiError::bad_request("the body must be JSON").into_response();
    } else {
        body
    };
    let path = format!("/{command}_profile");
    let forward_headers = ForwardHeaders::from_client(headers);
    let route = RouteRequest::bodyless(Endpoint::Chat, headers);
    let targets: Vec<(WorkerRole, Arc<Worker>)> = WorkerRole::ALL
        .into_iter()
        .filter_map(|role| Some((role, state.pick(role, &[], &route)?)))
        .collect();
    let answers = futures::future::join_all(
        targets
            .iter()
            .map(|(_, worker)| forward(state, worker, &path, &forward_headers, body.clone())),
    )
    .await;
    let mut out = Map::new();
    for ((role, _), answer) in targets.iter().zip(answers) {
        match answer {
            Ok(answer) => {
                out.insert(role.as_str().into(), answer.unwrap_or(Value::Null));
            }
            Err(failure) => return failure.into_response(),
        }
    }
    if out.values().all(Value::is_null) {
        return ApiError::service_unavailable("profiling endpoints are disabled on every instance")
            .into_response();
    }
    Json(Value::Object(out)).into_response()
}
