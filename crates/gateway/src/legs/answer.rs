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
use serde::de::IgnoredAny;
use tokio::time::timeout_at;

use super::{
    RequestContext, X_PDSERVE_DECODE, X_PDSERVE_DECODE_CACHE, X_PDSERVE_DECODE_PREDICTED,
    X_PDSERVE_PREFILL, X_PDSERVE_PREFILL_CACHE, X_PDSERVE_PREFILL_PREDICTED, X_PDSERVE_WORKER,
    X_PDSERVE_WORKER_CACHE, X_PDSERVE_WORKER_PREDICTED,
};
use crate::clients::worker_client::{Exchange, LegError, LegFault, LegRequest, LegResponse};
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::legs::first_token::FirstToken;
use crate::legs::first_token_guard::FirstTokenGuard;
use crate::legs::relay::{ByteStream, Relay};
use crate::legs::retry::{with_retries, Leg};
use crate::legs::sse::{edit_response_body, split_kv_params, AnswerSink, ResponseObjects};
use crate::policy::InFlight;
use crate::policy::{RequestOutcome, RouteRequest};
use crate::serving::Serving;

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
    /// A Responses answer's edits (and where its finished response is kept).
    pub responses: Option<Arc<dyn ResponseObjects>>,
    /// The data-parallel rank to name instead of the worker's own rotation (the replica
    /// the encoders published this request's embeddings to).
    pub dp_rank: Option<u32>,
    /// A 500 before the first byte escalates (the caller redoes the encoder stage)
    /// instead of being retried on another worker with the same body.
    pub reencode_on_500: bool,
    /// The first tokens the client already got from the prefill leg (a stream only):
    /// each attempt's stream must begin with them again, and is relayed without them.
    pub first_token: Option<Arc<FirstToken>>,
}

/// Sends the leg, retrying on another worker while nothing has reached the client.
pub async fn forward(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    leg: FinalLeg,
) -> Result<Response, Failure> {
    let (mut response, worker) = with_retries(state, ctx, route, leg.role, Leg::Final, |w| {
        attempt(state, ctx, &leg, w)
    })
    .await?;
    expose_final(ctx, &mut response, leg.role, &worker);
    Ok(response)
}

/// Sends the leg once, to `worker` (the consumer the encoders published to); the caller
/// decides about retries.
pub async fn forward_once(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: &Arc<Worker>,
) -> Result<Response, LegError> {
    let mut response = attempt(state, ctx, leg, worker.clone())
        .await
        .inspect_err(|e| state.report(worker, e))?;
    state.registry.record_answer(worker);
    expose_final(ctx, &mut response, leg.role, worker);
    Ok(response)
}

fn expose_final(
    ctx: &RequestContext,
    response: &mut Response,
    role: WorkerRole,
    worker: &Arc<Worker>,
) {
    let name = if role == WorkerRole::PrefillDecode {
        X_PDSERVE_WORKER
    } else {
        X_PDSERVE_DECODE
    };
    expose_worker(response, ctx, name, worker);
}

/// Notes that `worker` served the request (the dashboard's route) and, with
/// `--expose-routing` (the request keeps routing notes), names it in the response header
/// `name` and what it held of the prompt when chosen in the matching `…-cache` header.
pub fn expose_worker(
    response: &mut Response,
    ctx: &RequestContext,
    name: &'static str,
    worker: &Arc<Worker>,
) {
    let Some(notes) = &ctx.routing_notes else {
        ctx.journey.served_by(worker, None, None);
        return;
    };
    let held = notes.get(worker);
    let forecast = notes.forecast(worker);
    ctx.journey.served_by(worker, held, forecast);
    if let Ok(value) = HeaderValue::from_str(&worker.base) {
        response.headers_mut().insert(name, value);
    }
    let (cache_header, forecast_header) = match name {
        X_PDSERVE_PREFILL => (X_PDSERVE_PREFILL_CACHE, X_PDSERVE_PREFILL_PREDICTED),
        X_PDSERVE_DECODE => (X_PDSERVE_DECODE_CACHE, X_PDSERVE_DECODE_PREDICTED),
        _ => (X_PDSERVE_WORKER_CACHE, X_PDSERVE_WORKER_PREDICTED),
    };
    if let Some(value) = held.and_then(|m| HeaderValue::from_str(&m.header_value()).ok()) {
        response.headers_mut().insert(cache_header, value);
    }
    let predicted = forecast.and_then(|f| f.header_value());
    if let Some(value) = predicted.and_then(|v| HeaderValue::from_str(&v).ok()) {
        response.headers_mut().insert(forecast_header, value);
    }
}

/// One attempt on `worker`; the policy hears a failure when the worker was at fault
/// (not when it answered that a peer of it failed: [`LegError::blames_worker`]).
async fn attempt(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: Arc<Worker>,
) -> Result<Response, LegError> {
    let mut in_flight = Some(state.start_request(worker.clone()));
    let mut result = send_leg(state, ctx, leg, worker.clone(), &mut in_flight).await;
    if let Err(e) = &result {
        state.forget_unsent(&worker, ctx.prompt_tokens.as_deref(), e);
    }
    if let (Err(e), Some(in_flight)) = (&result, in_flight.as_mut()) {
        if e.blames_worker() {
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
    state: &Arc<Serving>,
    ctx: &RequestContext,
    leg: &FinalLeg,
    worker: Arc<Worker>,
    in_flight: &mut Option<InFlight>,
) -> Result<Response, LegError> {
    let label = format!("{} worker", leg.role);
    let rank = leg.dp_rank.or_else(|| worker.next_dp_rank());
    // Legs go over a direct connection that this task drives itself where the worker's
    // URL allows: a stream's burst of events is relayed in one write to the client, and
    // no connection task is woken.
    let url = worker.url(ctx.endpoint);
    let span =
        crate::observe::trace::leg(ctx.trace.as_ref(), leg.role.as_str(), &worker, url.as_str());
    let headers = crate::observe::trace::leg_headers(&ctx.headers, span.as_ref());
    let request = state
        .client
        .leg_request(url, leg.body.clone(), &headers, rank);
    let shape = BodyShape::Object;
    let sent = Instant::now();
    let started = start_answer(state, &worker, &label, request, leg.stream, shape).await;
    if leg.stream && started.is_ok() {
        ctx.journey.answer_began(&worker, sent.elapsed());
    }
    let started = match started {
        Ok(AnswerStart::Stream(head)) => Ok(AnswerStart::Stream(head)),
        other => {
            crate::observe::trace::leg_done(span.clone(), &other);
            other
        }
    };
    match started? {
        AnswerStart::Body(body) => {
            // The decode side's KV handle names internal hosts and blocks: kept for the
            // conversation's next turn when there is one, never shown to the client.
            let body = match &leg.responses {
                Some(objects) => {
                    let body = edit_response_body(body, objects.as_ref(), &worker.base);
                    objects.flush().await;
                    body
                }
                None => {
                    let (body, kv) = split_kv_params(body);
                    if let (Some(conversation), Some(kv)) = (&leg.conversation_id, kv) {
                        state.conversations.put(conversation, kv);
                    }
                    body
                }
            };
            if let Some(mut in_flight) = in_flight.take() {
                in_flight.set_outcome(RequestOutcome::Success);
            }
            state
                .metrics
                .observe_end_to_end(ctx.route, ctx.started.elapsed());
            Ok(json_response(body))
        }
        AnswerStart::Stream(head) => {
            let sink = match &leg.responses {
                Some(objects) => Some(AnswerSink::Responses(objects.clone())),
                None => leg
                    .conversation_id
                    .clone()
                    .map(|id| AnswerSink::Conversation {
                        cache: state.conversations.clone(),
                        id,
                    }),
            };
            let in_flight = in_flight
                .take()
                .unwrap_or_else(|| state.start_request(worker.clone()));
            let (content_type, mut relay) = relay(state, ctx, &worker, in_flight, head, sink, span);
            relay.first_token = leg.first_token.clone().map(FirstTokenGuard::new);
            Ok(stream_response(content_type, relay.into_stream()))
        }
    }
}

/// What a 2xx non-stream answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyShape {
    /// A JSON object (OpenAI's answers).
    Object,
    /// A JSON object or list (SGLang's `/generate` answers a batch with a list).
    ObjectOrArray,
}

/// How the answering leg began.
pub(crate) enum AnswerStart {
    /// A non-stream answer, complete and of the expected shape.
    Body(Bytes),
    /// A stream's first bytes and the rest.
    Stream(StreamHead),
}

/// Sends the leg that answers the client (`label` names its worker in messages) within
/// `--decode-timeout-secs` and waits for its first bytes; a non-stream answer is read
/// whole, bounded by `--stream-idle-timeout-secs` as a stream's silence is, and must be
/// JSON of `shape`. Decode time to first byte is recorded when the answer's head came,
/// in every mode.
pub(crate) async fn start_answer(
    state: &Serving,
    worker: &Worker,
    label: &str,
    request: LegRequest,
    stream: bool,
    shape: BodyShape,
) -> Result<AnswerStart, LegError> {
    let exchange = Exchange::new(worker, label, state.settings.decode_timeout);
    let sent = Instant::now();
    let response = exchange.send_leg(&state.client.direct, request).await?;
    if !stream {
        state.metrics.observe_decode_ttfb(sent.elapsed());
        let body = Exchange::new(worker, label, state.settings.stream_idle_timeout)
            .read_leg(response)
            .await?;
        // Checked without building the value: valid JSON that opens as `shape` says.
        let opens = body.trim_ascii_start().first();
        let (fits, what) = match shape {
            BodyShape::Object => (opens == Some(&b'{'), "a JSON object"),
            BodyShape::ObjectOrArray => (matches!(opens, Some(b'{' | b'[')), "JSON"),
        };
        if !(fits && serde_json::from_slice::<IgnoredAny>(&body).is_ok()) {
            return Err(exchange.error(
                LegFault::Broken,
                format!("answered 200 with a body that is not {what}"),
            ));
        }
        return Ok(AnswerStart::Body(body));
    }
    // Wait for the first byte before answering: until then a failure can still become
    // a proper error status or a retry on another worker.
    let head = first_event(&exchange, response).await?;
    state.metrics.observe_decode_ttfb(sent.elapsed());
    Ok(AnswerStart::Stream(head))
}

/// The relay of a streamed answer from `worker` (`head` and the rest), which takes over
/// `in_flight`, and the answer's `Content-Type`.
pub(crate) fn relay(
    state: &Serving,
    ctx: &RequestContext,
    worker: &Worker,
    in_flight: InFlight,
    head: StreamHead,
    sink: Option<AnswerSink>,
    trace: Option<pdserve_telemetry::ChildSpan>,
) -> (HeaderValue, Relay) {
    let StreamHead {
        content_type,
        first,
        upstream,
        decoded_elsewhere,
    } = head;
    ctx.journey.relay_takes_over();
    crate::observe::trace::leg_streaming(trace.as_ref());
    let relay = Relay {
        journey: Some(ctx.journey.clone()),
        first,
        upstream,
        decoded_elsewhere,
        idle_timeout: state.settings.stream_idle_timeout,
        sink,
        metrics: state.metrics.clone(),
        route: ctx.route,
        started: ctx.started,
        worker: worker.base.clone(),
        request_id: ctx.headers.request_id().to_string(),
        in_flight,
        trace,
        first_token: None,
    };
    (content_type, relay)
}

/// A 200 streaming `stream` as `content_type`, uncached.
pub(crate) fn stream_response<S>(content_type: HeaderValue, stream: S) -> Response
where
    S: futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    let mut response = Response::new(Body::from_stream(stream));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, content_type);
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A 200 carrying a worker's JSON body unchanged.
pub(crate) fn json_response(body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A streamed answer once its first bytes came.
pub(crate) struct StreamHead {
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
pub(crate) async fn first_event(
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
                LegFault::Broken,
                format!("failed: {}", crate::error::error_chain(&*e)),
            ))
        }
        Ok(None) => {
            return Err(exchange.error(
                LegFault::Broken,
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
