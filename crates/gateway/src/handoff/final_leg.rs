//! The leg that answers the client (decode, or a prefill_decode worker): worker choice,
//! retry before the first byte, time-to-first-byte limit, streaming relay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderValue, StatusCode};
use pdserve_protocol::WorkerRole;
use serde::de::IgnoredAny;
use tokio::time::timeout_at;

use super::relay::{split_kv_params, ByteStream, ConversationSink, Relay};
use super::retry::{with_retries, Leg};
use super::{RequestContext, X_PDSERVE_DECODE, X_PDSERVE_WORKER};
use crate::error::Failure;
use crate::policy::InFlight;
use crate::policy::{RequestOutcome, RouteRequest};
use crate::registry::Worker;
use crate::state::AppState;
use crate::worker_client::{Exchange, LegError, LegErrorKind, LegResponse};

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
    /// The data-parallel rank to name instead of the worker's own rotation (the replica
    /// the encoders published this request's embeddings to).
    pub dp_rank: Option<u32>,
    /// A 500 before the first byte escalates (the caller redoes the encoder stage)
    /// instead of being retried on another worker with the same body.
    pub reencode_on_500: bool,
}

/// Why a final leg sent with `reencode_on_500` failed.
#[derive(Debug)]
pub struct FinalLegError {
    /// What the client gets if nothing else is tried.
    pub failure: Failure,
    /// A worker answered 500 before its first byte: redoing the encoder stage may help.
    pub reencode: bool,
}

/// Sends the leg, retrying on another worker while nothing has reached the client.
pub async fn forward(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    leg: FinalLeg,
) -> Result<Response, Failure> {
    forward_reencodable(state, ctx, route, leg)
        .await
        .map_err(|e| e.failure)
}

/// Like [`forward`], and says whether the failure was an escalated 500.
pub async fn forward_reencodable(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    leg: FinalLeg,
) -> Result<Response, FinalLegError> {
    let escalated = AtomicBool::new(false);
    let result = with_retries(state, ctx, route, leg.role, Leg::Final, |w| {
        let escalated = &escalated;
        let leg = &leg;
        async move {
            let result = attempt(state, ctx, leg, w).await;
            if result.as_ref().is_err_and(|e| e.escalated) {
                escalated.store(true, Ordering::Relaxed);
            }
            result
        }
    })
    .await;
    match result {
        Ok((mut response, worker)) => {
            expose_final(state, &mut response, leg.role, &worker);
            Ok(response)
        }
        Err(failure) => Err(FinalLegError {
            failure,
            reencode: escalated.load(Ordering::Relaxed),
        }),
    }
}

/// Sends the leg once, to `worker` (the consumer the encoders published to); the caller
/// decides about retries.
pub async fn forward_once(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: &Arc<Worker>,
) -> Result<Response, LegError> {
    let mut response = attempt(state, ctx, leg, worker.clone())
        .await
        .inspect_err(|e| state.report(worker, e))?;
    expose_final(state, &mut response, leg.role, worker);
    Ok(response)
}

fn expose_final(state: &AppState, response: &mut Response, role: WorkerRole, worker: &Worker) {
    if state.config.expose_routing {
        let name = if role == WorkerRole::PrefillDecode {
            X_PDSERVE_WORKER
        } else {
            X_PDSERVE_DECODE
        };
        expose_worker(response, name, worker);
    }
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
    let mut result = send_leg(state, ctx, leg, worker, &mut in_flight).await;
    if let (Err(e), Some(in_flight)) = (&result, in_flight.as_mut()) {
        if e.is_worker_fault() {
            in_flight.set_outcome(RequestOutcome::Failure);
        }
    }
    if let Err(e) = &mut result {
        // vLLM answers 500 when it could not obtain an encoder's embedding, among its
        // other retryable internal errors: publishing the item again is what helps.
        e.escalated = leg.reencode_on_500 && e.status == Some(StatusCode::INTERNAL_SERVER_ERROR);
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
    let body = leg.body.clone();
    let rank = leg.dp_rank.or_else(|| worker.next_dp_rank());
    // Legs go over a direct connection that this task drives itself where the worker's
    // URL allows: a stream's burst of events is relayed in one write to the client, and
    // no connection task is woken.
    let request = state
        .client
        .leg_request(worker.url(ctx.endpoint), body, &ctx.headers, rank);
    let response = exchange.send_leg(&state.client.direct, request).await?;
    if !leg.stream {
        state.metrics.observe_decode_ttfb(sent.elapsed());
        // A non-stream answer's body may take the whole generation: bound it by the
        // stream idle limit, as a stream's silence is.
        let body = Exchange::new(&worker, &label, state.config.stream_idle_timeout)
            .read_leg(response)
            .await?;
        return finish_body(state, ctx, leg, in_flight, &exchange, body);
    }
    // Wait for the first byte before answering: until then a failure can still become
    // a proper error status or a retry on another worker.
    let head = first_event(&exchange, response).await?;
    state.metrics.observe_decode_ttfb(sent.elapsed());
    Ok(relay_response(state, ctx, leg, worker, in_flight, head))
}

/// The client's answer to a non-stream leg: the worker's JSON `body` without the decode
/// side's KV handle.
// The same error the async legs return; boxing it only here would not shrink them.
#[allow(clippy::result_large_err)]
fn finish_body(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    in_flight: &mut Option<InFlight>,
    exchange: &Exchange<'_>,
    body: Bytes,
) -> Result<Response, LegError> {
    // Checked without building the value: valid JSON that opens with `{` is an object.
    let is_object = body.trim_ascii_start().starts_with(b"{")
        && serde_json::from_slice::<IgnoredAny>(&body).is_ok();
    if !is_object {
        return Err(exchange.error(
            LegErrorKind::Transport,
            "answered 200 with a body that is not a JSON object",
        ));
    }
    // The decode side's KV handle names internal hosts and blocks: kept for the
    // conversation's next turn when there is one, never shown to the client.
    let (body, kv) = split_kv_params(body);
    if let (Some(conversation), Some(kv)) = (&leg.conversation_id, kv) {
        state.conversations.put(conversation, kv);
    }
    if let Some(mut in_flight) = in_flight.take() {
        in_flight.set_outcome(RequestOutcome::Success);
    }
    state
        .metrics
        .observe_end_to_end(ctx.route, ctx.started.elapsed());
    Ok(json_response(body))
}

/// The client's streamed response: `head` and the rest of the upstream, relayed; the
/// relay takes over `in_flight`.
fn relay_response(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: Arc<Worker>,
    in_flight: &mut Option<InFlight>,
    head: StreamHead,
) -> Response {
    let StreamHead {
        content_type,
        first,
        upstream,
        decoded_elsewhere,
    } = head;
    let relay = Relay {
        first,
        upstream,
        decoded_elsewhere,
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
    response
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

/// A streamed answer once its first bytes came.
pub(super) struct StreamHead {
    /// The worker's `Content-Type` (SSE when it named none).
    pub content_type: HeaderValue,
    /// The first chunk.
    pub first: Bytes,
    /// The rest of the stream.
    pub upstream: ByteStream,
    /// Whether the stream is decoded on a connection task of its own (reqwest's).
    pub decoded_elsewhere: bool,
}

/// Waits, within `exchange`'s deadline, for the first chunk of a streamed `response`:
/// a stream that ends or fails before it is a transport error.
pub(super) async fn first_event(
    exchange: &Exchange<'_>,
    response: LegResponse,
) -> Result<StreamHead, LegError> {
    let content_type = response
        .content_type()
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("text/event-stream"));
    let decoded_elsewhere = matches!(response, LegResponse::Pooled(_));
    let mut upstream = response.into_stream();
    let first = match timeout_at(exchange.deadline(), upstream.next()).await {
        Err(_) => return Err(exchange.timed_out()),
        Ok(Some(Ok(first))) => first,
        Ok(Some(Err(e))) => {
            return Err(exchange.error(
                LegErrorKind::Transport,
                format!("failed: {}", crate::error::error_chain(&*e)),
            ))
        }
        Ok(None) => {
            return Err(exchange.error(
                LegErrorKind::Transport,
                "closed the stream before sending anything",
            ))
        }
    };
    Ok(StreamHead {
        content_type,
        first,
        upstream,
        decoded_elsewhere,
    })
}
