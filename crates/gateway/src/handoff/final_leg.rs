//! The leg that answers the client (decode, or an aggregated worker): worker choice,
//! retry before the first byte, time-to-first-byte limit, streaming relay.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderValue, StatusCode};
use pdserve_protocol::ApiError;
use serde_json::Value;
use tokio::time::timeout_at;

use super::relay::{kv_params_of, ConversationSink, Relay};
use super::RequestContext;
use crate::error::{error_chain, truncate, Failure};
use crate::registry::{InFlight, Pool, Role, Worker};
use crate::server::AppState;

/// What to send on the final leg.
pub struct FinalLeg<'a> {
    /// The pool to pick workers from.
    pub pool: &'a Pool,
    /// The pool's role (for messages).
    pub role: Role,
    /// The request body.
    pub body: Bytes,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The conversation whose next turn gets this leg's final KV params.
    pub conversation_id: Option<String>,
}

/// How one attempt failed.
enum AttemptError {
    /// Failed before anything reached the client and another worker may succeed.
    Retryable(Failure),
    /// Final: a client error, a timeout.
    Final(Failure),
}

/// Sends the leg, retrying on another worker while nothing has reached the client.
pub async fn forward(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: FinalLeg<'_>,
) -> Result<Response, Failure> {
    let attempts = 1 + state.config.decode_retries as usize;
    let mut tried: Vec<Arc<Worker>> = Vec::new();
    let mut last = None;
    while tried.len() < attempts {
        let Some(worker) = leg.pool.next_excluding(&tried) else {
            break;
        };
        if !tried.is_empty() {
            state.metrics.inc_decode_retries();
            tracing::warn!(
                request_id = ctx.headers.request_id(),
                worker = %worker.base,
                "retrying the {} leg on another worker",
                leg.role
            );
        }
        tried.push(worker.clone());
        match attempt(state, ctx, &leg, worker).await {
            Ok(response) => return Ok(response),
            Err(AttemptError::Final(failure)) => return Err(failure),
            Err(AttemptError::Retryable(failure)) => last = Some(failure),
        }
    }
    Err(last.unwrap_or_else(|| {
        ApiError::service_unavailable(format!("no {} worker is configured", leg.role)).into()
    }))
}

async fn attempt(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg<'_>,
    worker: Arc<Worker>,
) -> Result<Response, AttemptError> {
    let in_flight = InFlight::start(worker.clone());
    let sent = Instant::now();
    let deadline = tokio::time::Instant::now() + state.config.decode_timeout;
    let timed_out = || {
        AttemptError::Final(
            ApiError::gateway_timeout(format!(
                "{} worker {} did not answer within {:?}",
                leg.role, worker.base, state.config.decode_timeout
            ))
            .into(),
        )
    };
    let unreachable = |e: &reqwest::Error| {
        AttemptError::Retryable(
            ApiError::bad_gateway(format!(
                "{} worker {} failed: {}",
                leg.role,
                worker.base,
                error_chain(e)
            ))
            .into(),
        )
    };

    let request = state
        .upstream
        .post_json(worker.url(ctx.endpoint), leg.body.clone(), &ctx.headers)
        .send();
    let response = match timeout_at(deadline, request).await {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => return Err(unreachable(&e)),
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    if !status.is_success() {
        let body = match timeout_at(deadline, response.bytes()).await {
            Ok(Ok(b)) => b,
            _ => Bytes::new(),
        };
        if status.is_client_error() {
            return Err(AttemptError::Final(Failure::from_upstream_client_error(
                status,
                body,
                &worker.base,
            )));
        }
        let text = String::from_utf8_lossy(&body);
        return Err(AttemptError::Retryable(
            ApiError::bad_gateway(format!(
                "{} worker {} answered {status}: {}",
                leg.role,
                worker.base,
                truncate(text.trim(), 512)
            ))
            .into(),
        ));
    }

    if !leg.stream {
        state.metrics.observe_decode_ttfb(sent.elapsed());
        let body =
            match tokio::time::timeout(state.config.stream_idle_timeout, response.bytes()).await {
                Err(_) => return Err(timed_out()),
                Ok(Err(e)) => return Err(unreachable(&e)),
                Ok(Ok(b)) => b,
            };
        if !serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object()) {
            return Err(AttemptError::Retryable(
                ApiError::bad_gateway(format!(
                    "{} worker {} answered 200 with a body that is not a JSON object",
                    leg.role, worker.base
                ))
                .into(),
            ));
        }
        if let Some(conversation) = &leg.conversation_id {
            if let Some(kv) = kv_params_of(&body) {
                state.conversations.put(conversation, kv);
            }
        }
        drop(in_flight);
        state
            .metrics
            .observe_end_to_end(ctx.route, ctx.started.elapsed());
        return Ok(json_response(body));
    }

    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("text/event-stream"));
    let mut upstream = response.bytes_stream().boxed();
    // Wait for the first byte before answering: until then a failure can still become
    // a proper error status or a retry on another worker.
    let first = match timeout_at(deadline, upstream.next()).await {
        Err(_) => return Err(timed_out()),
        Ok(Some(Ok(first))) => first,
        Ok(Some(Err(e))) => return Err(unreachable(&e)),
        Ok(None) => {
            return Err(AttemptError::Retryable(
                ApiError::bad_gateway(format!(
                    "{} worker {} closed the stream before sending anything",
                    leg.role, worker.base
                ))
                .into(),
            ))
        }
    };
    state.metrics.observe_decode_ttfb(sent.elapsed());
    let relay = Relay {
        first,
        upstream,
        idle_timeout: state.config.stream_idle_timeout,
        conversation: leg.conversation_id.clone().map(|id| ConversationSink {
            cache: state.conversations.clone(),
            id,
        }),
        metrics: state.metrics.clone(),
        route: ctx.route,
        started: ctx.started,
        worker: worker.base.clone(),
        request_id: ctx.headers.request_id().to_string(),
        in_flight,
    };
    let mut response = Response::new(Body::from_stream(relay.into_stream()));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, content_type);
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

/// A 200 carrying a worker's JSON body unchanged.
fn json_response(body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
