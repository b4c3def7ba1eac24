//! axum routes, tower layers and graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use pdserve_protocol::ApiError;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::args::GatewayConfig;
use crate::conversation::ConversationCache;
use crate::error::{error_chain, truncate, Failure, GatewayError};
use crate::handoff::{self, RequestContext};
use crate::metrics::Metrics;
use crate::registry::{Endpoint, Mode, Registry};
use crate::upstream::{ForwardHeaders, Upstream};
use crate::validation::{body_rejection, GenerateRequest};

/// State shared by all requests.
#[derive(Debug)]
pub struct AppState {
    /// The resolved configuration.
    pub config: GatewayConfig,
    /// Worker pools.
    pub registry: Registry,
    /// The upstream HTTP client.
    pub upstream: Upstream,
    /// Decode KV handles kept for conversations' next turns.
    pub conversations: Arc<ConversationCache>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl AppState {
    /// State for `config`.
    pub fn new(config: GatewayConfig) -> Result<Self, GatewayError> {
        let metrics = Arc::new(Metrics::default());
        let registry = Registry::new(&config.prefill, &config.decode, &config.worker, &metrics);
        Ok(Self {
            upstream: Upstream::new(&config)?,
            conversations: Arc::new(ConversationCache::new(
                config.max_conversations,
                config.conversation_ttl,
            )),
            registry,
            metrics,
            config,
        })
    }
}

/// The gateway's routes and layers for `config`.
pub fn router(config: GatewayConfig) -> Result<Router, GatewayError> {
    let limit = config.max_body_bytes;
    let state = Arc::new(AppState::new(config)?);
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http())
        // Outermost: every request (and so both legs and the response) has an id.
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state))
}

/// Serves the gateway on `listener` until `shutdown` completes, then drains open requests.
pub async fn serve(
    listener: TcpListener,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let app = router(config)?;
    // Stream chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
    // one back until the client's delayed ACK (tens of milliseconds per token).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Completions, headers, body).await
}

async fn generate(
    state: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let ctx = RequestContext {
        endpoint,
        route: endpoint.path(),
        headers: ForwardHeaders::from_client(&headers),
        started: Instant::now(),
    };
    let result = async {
        let body = body.map_err(|r| body_rejection(r, state.config.max_body_bytes))?;
        let (request, conversation_id) = GenerateRequest::parse(endpoint, &body)?;
        handoff::generate(&state, &ctx, request, conversation_id).await
    }
    .await;
    let response = match result {
        Ok(response) => response,
        Err(failure) => {
            tracing::info!(
                request_id = ctx.headers.request_id(),
                status = failure.status().as_u16(),
                "request failed: {failure:?}"
            );
            state
                .metrics
                .observe_end_to_end(ctx.route, ctx.started.elapsed());
            failure.into_response()
        }
    };
    state
        .metrics
        .record_request(ctx.route, response.status().as_u16());
    response
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    const ROUTE: &str = "/v1/models";
    let response = match fetch_models(&state, &ForwardHeaders::from_client(&headers)).await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(failure) => failure.into_response(),
    };
    state
        .metrics
        .record_request(ROUTE, response.status().as_u16());
    response
}

/// `/v1/models` of a decode (or aggregated) worker, passed through.
async fn fetch_models(state: &AppState, headers: &ForwardHeaders) -> Result<Bytes, Failure> {
    let worker = state
        .registry
        .models_worker()
        .ok_or_else(|| ApiError::service_unavailable("no worker is configured"))?;
    let exchange = async {
        let response = state
            .upstream
            .get(worker.models_url(), headers)
            .send()
            .await?;
        let status = response.status();
        Ok::<_, reqwest::Error>((status, response.bytes().await?))
    };
    let (status, body) = match tokio::time::timeout(state.config.decode_timeout, exchange).await {
        Err(_) => {
            return Err(ApiError::gateway_timeout(format!(
                "worker {} did not list its models within {:?}",
                worker.base, state.config.decode_timeout
            ))
            .into())
        }
        Ok(Err(e)) => {
            return Err(ApiError::bad_gateway(format!(
                "worker {} failed: {}",
                worker.base,
                error_chain(&e)
            ))
            .into())
        }
        Ok(Ok(answer)) => answer,
    };
    if status.is_client_error() {
        return Err(Failure::from_upstream_client_error(
            status,
            body,
            &worker.base,
        ));
    }
    let is_json_object = serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object());
    if !status.is_success() || !is_json_object {
        let text = String::from_utf8_lossy(&body);
        return Err(ApiError::bad_gateway(format!(
            "worker {} answered /v1/models with {status}: {}",
            worker.base,
            truncate(text.trim(), 512)
        ))
        .into());
    }
    Ok(body)
}

async fn health(State(state): State<Arc<AppState>>) -> Json<Value> {
    let registry = &state.registry;
    let mode = match registry.mode() {
        Mode::Disaggregated => "disaggregated",
        Mode::Aggregated => "aggregated",
        Mode::Unavailable => "unavailable",
    };
    let pool = |p: &crate::registry::Pool| {
        p.workers()
            .iter()
            .map(|w| json!({"url": w.base, "in_flight": w.in_flight()}))
            .collect::<Vec<_>>()
    };
    Json(json!({
        "status": "ok",
        "mode": mode,
        "cached_conversations": state.conversations.len(),
        "pools": {
            "prefill": registry.prefill.len(),
            "decode": registry.decode.len(),
            "worker": registry.aggregated.len(),
        },
        "workers": {
            "prefill": pool(&registry.prefill),
            "decode": pool(&registry.decode),
            "worker": pool(&registry.aggregated),
        },
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such route.")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "Method not allowed on this route.",
    )
}
