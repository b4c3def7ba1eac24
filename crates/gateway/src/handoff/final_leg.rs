//! The leg that answers the client (decode, or a prefill_decode worker): worker choice,
//! retry before the first byte, time-to-first-byte limit, streaming relay.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderValue, StatusCode};
use pdserve_protocol::WorkerRole;
use serde_json::Value;
use tokio::time::timeout_at;

use super::relay::{kv_params_of, ConversationSink, Relay};
use super::retry::{with_retries, Leg};
use super::{RequestContext, X_PDSERVE_DECODE, X_PDSERVE_WORKER};
use crate::error::Failure;
use crate::policy::{RequestOutcome, RouteRequest};
use crate::registry::{InFlight, Worker};
use crate::state::AppState;
use crate::upstream::{Exchange, LegError, LegErrorKind};

/// What to send on the final leg.
pub struct FinalLeg {
    /// The role of the workers to send it to.
    pub role: WorkerRole,
    /// The request body.
    pub body: Bytes,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The conversation whose next turn gets this leg's final KV params.
    pub conversation_id: Option<String>,
}

/// Sends the leg, retrying on another worker while nothing has reached the client.
pub async fn forward(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    leg: FinalLeg,
) -> Result<Response, Failure> {
    let (mut response, worker) = with_retries(state, ctx, route, leg.role, Leg::Final, |w| {
        attempt(state, ctx, &leg, w)
    })
    .await?;
    if state.config.expose_routing {
        let name = if leg.role == WorkerRole::PrefillDecode {
            X_PDSERVE_WORKER
        } else {
            X_PDSERVE_DECODE
        };
        expose_worker(&mut response, name, &worker);
    }
    Ok(response)
}

/// Names `worker` in the response header `name` (with `--expose-routing`).
pub fn expose_worker(response: &mut Response, name: &'static str, worker: &Worker) {
    if let Ok(value) = HeaderValue::from_str(&worker.base) {
        response.headers_mut().insert(name, value);
    }
}

/// One attempt on `worker`; the policy hears a failure when the worker was at fault.
async fn attempt(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: Arc<Worker>,
) -> Result<Response, LegError> {
    let mut in_flight = Some(state.start_request(worker.clone()));
    let result = send_leg(state, ctx, leg, worker, &mut in_flight).await;
    if let (Err(e), Some(in_flight)) = (&result, in_flight.as_mut()) {
        if e.is_worker_fault() {
            in_flight.set_outcome(RequestOutcome::Failure);
        }
    }
    result
}

/// Sends the leg and answers with its body or its relayed stream; a stream's relay takes
/// over `in_flight`.
async fn send_leg(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: Arc<Worker>,
    in_flight: &mut Option<InFlight>,
) -> Result<Response, LegError> {
    let label = format!("{} worker", leg.role);
    let exchange = Exchange::new(&worker, &label, state.config.decode_timeout);
    let sent = Instant::now();
    let request = state
        .upstream
        .post_leg(&worker, ctx.endpoint, leg.body.clone(), &ctx.headers);
    let response = exchange.send(request).await?;

    if !leg.stream {
        state.metrics.observe_decode_ttfb(sent.elapsed());
        // A non-stream answer's body may take the whole generation: bound it by the
        // stream idle limit, as a stream's silence is.
        let body = Exchange::new(&worker, &label, state.config.stream_idle_timeout)
            .read(response)
            .await?;
        if !serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object()) {
            return Err(exchange.error(
                LegErrorKind::Transport,
                "answered 200 with a body that is not a JSON object",
            ));
        }
        if let Some(conversation) = &leg.conversation_id {
            if let Some(kv) = kv_params_of(&body) {
                state.conversations.put(conversation, kv);
            }
        }
        if let Some(mut in_flight) = in_flight.take() {
            in_flight.set_outcome(RequestOutcome::Success);
        }
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
    let first = match timeout_at(exchange.deadline(), upstream.next()).await {
        Err(_) => return Err(exchange.timed_out()),
        Ok(Some(Ok(first))) => first,
        Ok(Some(Err(e))) => return Err(exchange.transport(&e)),
        Ok(None) => {
            return Err(exchange.error(
                LegErrorKind::Transport,
                "closed the stream before sending anything",
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
        in_flight: in_flight
            .take()
            .unwrap_or_else(|| state.start_request(worker.clone())),
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
