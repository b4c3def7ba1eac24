//! SGLang's bootstrap handoff (`--protocol sglang`), with a fast path that never hangs.
//!
//! One body, with `bootstrap_host` (P's host), `bootstrap_port` (P's bootstrap port) and
//! `bootstrap_room` (random, below 2^63; per item for batches and chat `n` > 1) injected,
//! goes to a prefill worker P and a decode worker D at once; the workers meet by room
//! and P sends the room's KV to D. D's bytes go to the client as they arrive, without
//! waiting for P's HTTP answer, yet P's outcome stays attached to the request (SGLang's
//! router PR that removed the wait dropped it, so failed prefills hung or "succeeded"):
//!
//! - P fails (non-2xx, transport, timeout) before D's first byte: D is dropped (its
//!   connection closed) and the client gets P's error (4xx passed through, else 502/504),
//!   retried on a fresh pair first where that is safe;
//! - P fails after D's first byte: an OpenAI-shaped error event and `[DONE]` end the
//!   stream (D's own `[DONE]` is held until P has answered);
//! - D fails: P's task is aborted, which drops its connection;
//! - the client goes away: dropping the body drops D's relay and aborts P's task;
//! - a non-stream answer is returned once both have answered;
//! - input logprobs (`return_logprob`, or `logprobs` with `echo`) wait for P and are
//!   merged into D's answer ([`crate::legs::prompt_logprobs`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use axum::response::Response;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use pdserve_protocol::{ApiError, WorkerRole};
use reqwest::Url;
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::sglang_route::wants_input_logprobs;
pub use super::sglang_route::{SglangRoute, GENERATE_ROUTE};
use super::{RequestContext, X_PDSERVE_DECODE, X_PDSERVE_PREFILL};
use crate::clients::worker_client::{Exchange, LegError, LegFault, LegRequest};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::request::{append_verbatim, ClientRequest};
use crate::legs::answer::{
    expose_worker, json_response, relay, start_answer, stream_response, AnswerStart, BodyShape,
};
use crate::legs::prefill::send_prefill;
use crate::legs::prompt_logprobs::PrefillLogprobs;
use crate::legs::retry::{with_retries, Leg};
use crate::legs::sse::{
    edit_response_body, split_kv_params, AnswerSink, ResponseObjects, StreamDialect,
};
use crate::policy::{RequestOutcome, RouteRequest};
use crate::serving::Serving;
use crate::serving::ServingMetrics;

/// Serves a validated chat or completion request with SGLang's bootstrap handoff.
pub async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: ClientRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    let route = match ctx.endpoint {
        Endpoint::Chat => SglangRoute::Chat,
        Endpoint::Completions => SglangRoute::Completions,
        Endpoint::Responses => SglangRoute::Responses,
    };
    let body = match serde_json::from_slice::<Value>(&request.to_body()) {
        Ok(Value::Object(map)) => map,
        _ => return Err(ApiError::internal("the request did not serialize to an object").into()),
    };
    // The client's own number texts, written back byte for byte in every leg's body.
    let verbatim = match &request {
        ClientRequest::Chat(r) => r.verbatim_numbers.clone(),
        ClientRequest::Completion(r) => r.verbatim_numbers.clone(),
    };
    let routing = ctx.route_for(&request, conversation_id.as_deref());
    serve_body(state, ctx, route, body, verbatim, &routing, None).await
}

/// What every attempt of one request sends.
struct Plan {
    route: SglangRoute,
    body: Map<String, Value>,
    /// Top-level numbers sent as the client wrote them (also in `body`, for reading).
    verbatim: Vec<(String, String)>,
    stream: bool,
    input_logprobs: bool,
    /// A Responses answer's edits.
    responses: Option<Arc<dyn ResponseObjects>>,
}

/// Runs attempts on fresh P/D pairs while nothing reached the client and the failure is
/// not the request's fault.
pub(crate) async fn serve_body(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: SglangRoute,
    body: Map<String, Value>,
    verbatim: Vec<(String, String)>,
    routing: &RouteRequest<'_>,
    responses: Option<Arc<dyn ResponseObjects>>,
) -> Result<Response, Failure> {
    let plan = Plan {
        route,
        verbatim,
        responses,
        stream: body.get("stream").and_then(Value::as_bool) == Some(true),
        input_logprobs: wants_input_logprobs(route, &body),
        body,
    };
    // Decode workers that failed this request; prefill workers are tracked by the retry
    // loop, which drives the pair choice.
    let failed_decode = Mutex::new(Vec::new());
    let (response, _prefill) = with_retries(
        state,
        ctx,
        routing,
        WorkerRole::Prefill,
        Leg::Prefill,
        |prefill| attempt(state, ctx, &plan, routing, prefill, &failed_decode),
    )
    .await?;
    Ok(response)
}

/// One attempt on `prefill` and a decode worker chosen for it.
async fn attempt(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    plan: &Plan,
    routing: &RouteRequest<'_>,
    prefill: Arc<Worker>,
    failed_decode: &Mutex<Vec<Arc<Worker>>>,
) -> Result<Response, LegError> {
    let tried = failed_decode.lock().expect("not poisoned").clone();
    let Some(decode) = state.pick(WorkerRole::Decode, &tried, routing) else {
        return Err(final_error(state.refuse(WorkerRole::Decode)));
    };
    let mut body = plan.body.clone();
    let host = prefill.spec.url.host_str().unwrap_or_default();
    let rooms =
        plan.route
            .shape()
            .inject(&mut body, host, prefill.spec.bootstrap_port, rand::random);
    tracing::debug!(
        request_id = ctx.headers.request_id(),
        prefill = %prefill.base,
        decode = %decode.base,
        ?rooms,
        "bootstrap handoff"
    );
    for (key, _) in &plan.verbatim {
        body.remove(key);
    }
    let encode = |body: &Map<String, Value>| {
        let mut bytes = serde_json::to_vec(body).unwrap_or_default();
        append_verbatim(&mut bytes, &plan.verbatim);
        Bytes::from(bytes)
    };
    let decode_body = encode(&body);
    // P answers in one JSON body when its input logprobs are needed (an SSE answer would
    // have to be reassembled); the rooms are the same.
    let prefill_body = if plan.input_logprobs && plan.stream {
        body.insert("stream".into(), Value::Bool(false));
        encode(&body)
    } else if plan.route == SglangRoute::Responses {
        // P's answer is one token no client will ask for again.
        body.insert("store".into(), Value::Bool(false));
        encode(&body)
    } else {
        decode_body.clone()
    };
    let mut p_leg = PrefillLeg::spawn(state, ctx, plan.route, prefill.clone(), prefill_body);
    let mut d_in_flight = state.start_request(decode.clone());
    let d_span = crate::observe::trace::leg(ctx.trace.as_ref(), "decode", &decode, &decode.base);
    let d_leg = d_span.clone();
    let decode_start = async {
        let request = leg_request(state, ctx, plan.route, &decode, decode_body, d_leg.as_ref())
            .map_err(|why| decode_exchange_error(state, &decode, why))?;
        let started = start_answer(
            state,
            &decode,
            "decode worker",
            request,
            plan.stream,
            BodyShape::ObjectOrArray,
        )
        .await;
        if !matches!(started, Ok(AnswerStart::Stream(_))) {
            crate::observe::trace::leg_done(d_leg.clone(), &started);
        }
        started
    };
    tokio::pin!(decode_start);
    let started = loop {
        tokio::select! {
            biased;
            started = &mut decode_start => break started,
            failure = p_leg.failure(), if p_leg.is_pending() => {
                if let Some(e) = failure {
                    // Returning drops D's exchange, which closes its connection.
                    return Err(e);
                }
            }
        }
    };
    let started = match started {
        Ok(started) => {
            state.registry.record_answer(&decode);
            started
        }
        Err(e) => {
            // D's failure may only echo P's (no KV ever came): report the cause.
            if let Some(Some(p_error)) = p_leg.failure().now_or_never() {
                return Err(p_error);
            }
            if e.is_worker_fault() {
                d_in_flight.set_outcome(RequestOutcome::Failure);
            }
            state.report(&decode, &e);
            failed_decode
                .lock()
                .expect("not poisoned")
                .push(decode.clone());
            // Dropping `p_leg` aborts P's task and so its connection.
            return Err(reported(e));
        }
    };
    if state.settings.sglang_wait_prefill_head && p_leg.is_pending() {
        if let Some(e) = p_leg.wait_head().await {
            return Err(e);
        }
    }
    let merge = if plan.input_logprobs {
        if let Some(e) = p_leg.failure().await {
            return Err(e);
        }
        p_leg.body().map(|b| PrefillLogprobs::from_answer(b))
    } else {
        None
    };
    let mut response = match started {
        AnswerStart::Body(body) => {
            // Nothing reached the client yet: P's failure is still a proper status.
            if let Some(e) = p_leg.failure().await {
                return Err(e);
            }
            let body = match &plan.responses {
                Some(objects) => edit_response_body(body, objects.as_ref(), &decode.base),
                None => split_kv_params(body).0,
            };
            let body = match merge {
                Some(merge) => merge.merge_body(body),
                None => body,
            };
            d_in_flight.set_outcome(RequestOutcome::Success);
            state
                .metrics
                .observe_end_to_end(ctx.route, ctx.started.elapsed());
            json_response(body)
        }
        AnswerStart::Stream(head) => {
            let sink = plan.responses.clone().map(AnswerSink::Responses);
            let (content_type, relay) = relay(state, ctx, &decode, d_in_flight, head, sink, d_span);
            let attached = Attached {
                dialect: plan.route.dialect(),
                relay: Some(relay.into_stream().boxed()),
                prefill: p_leg.is_pending().then_some(p_leg),
                merge,
                held: None,
                at_boundary: true,
                metrics: state.metrics.clone(),
            };
            stream_response(content_type, attached.into_stream())
        }
    };
    expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &prefill);
    expose_worker(&mut response, ctx, X_PDSERVE_DECODE, &decode);
    Ok(response)
}

/// The failure of a decode leg whose request could not be built.
fn decode_exchange_error(state: &Serving, decode: &Worker, why: String) -> LegError {
    Exchange::new(decode, "decode worker", state.settings.decode_timeout)
        .error(LegFault::Failed, why)
}

/// A failure no other pair can fix (nothing is retried after it).
fn final_error(error: ApiError) -> LegError {
    LegError {
        failure: error.into(),
        kind: LegFault::Rejected,
        status: None,
        escalated: false,
    }
}

/// A failure whose worker was already reported to passive health: the retry loop, which
/// reports the prefill worker's failures, must neither count it again nor blame P for D.
fn reported(mut e: LegError) -> LegError {
    if matches!(e.kind, LegFault::Unreachable | LegFault::Broken) {
        e.kind = LegFault::Failed;
    }
    e
}

/// The request for one leg of `route` to `worker`.
fn leg_request(
    state: &Serving,
    ctx: &RequestContext,
    route: SglangRoute,
    worker: &Worker,
    body: Bytes,
    span: Option<&pdserve_telemetry::ChildSpan>,
) -> Result<LegRequest, String> {
    let rank = worker.next_dp_rank();
    let generate_url;
    let url = match route {
        SglangRoute::Chat => worker.url(Endpoint::Chat),
        SglangRoute::Completions => worker.url(Endpoint::Completions),
        SglangRoute::Responses => worker.url(Endpoint::Responses),
        SglangRoute::Generate => {
            generate_url = Url::parse(&format!("{}{GENERATE_ROUTE}", worker.base))
                .map_err(|e| format!("has no /generate URL: {e}"))?;
            &generate_url
        }
    };
    let headers = crate::observe::trace::leg_headers(&ctx.headers, span);
    Ok(state.client.leg_request(url, body, &headers, rank))
}

/// P's leg, running as a task of its own so that it progresses while D's bytes are
/// relayed; dropping it aborts the task, which closes P's connection.
struct PrefillLeg {
    task: Option<JoinHandle<Result<Bytes, LegError>>>,
    head: Option<oneshot::Receiver<()>>,
    /// P's 2xx body, once it answered.
    body: Option<Bytes>,
    worker: Arc<Worker>,
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            tracing::debug!(worker = %self.worker.base, "aborting the prefill leg");
            task.abort();
        }
    }
}

impl PrefillLeg {
    fn spawn(
        state: &Arc<Serving>,
        ctx: &RequestContext,
        route: SglangRoute,
        worker: Arc<Worker>,
        body: Bytes,
    ) -> Self {
        let (head_tx, head_rx) = oneshot::channel();
        let state = state.clone();
        let ctx = ctx.clone();
        let leg_worker = worker.clone();
        let task = tokio::spawn(async move {
            let worker = leg_worker;
            let span =
                crate::observe::trace::leg(ctx.trace.as_ref(), "prefill", &worker, &worker.base);
            let request = leg_request(&state, &ctx, route, &worker, body, span.as_ref());
            let result = send_prefill(&state, &worker, request, Some(head_tx), |body| {
                check_prefill_answer(body).map(|()| body.clone())
            })
            .await;
            crate::observe::trace::leg_done(span, &result);
            if let Err(e) = &result {
                state.report(&worker, e);
            }
            result.map_err(reported)
        });
        Self {
            task: Some(task),
            head: Some(head_rx),
            body: None,
            worker,
        }
    }

    /// Whether P has not answered yet.
    fn is_pending(&self) -> bool {
        self.task.is_some()
    }

    /// P's 2xx body, once it succeeded.
    fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }

    /// Waits for P's outcome; returns its failure (once), or `None` once it succeeded.
    async fn failure(&mut self) -> Option<LegError> {
        let task = self.task.as_mut()?;
        let joined = task.await;
        self.task = None;
        match joined {
            Ok(Ok(body)) => {
                self.body = Some(body);
                None
            }
            Ok(Err(e)) => Some(e),
            Err(e) => Some(final_error(ApiError::bad_gateway(format!(
                "prefill leg to {} ended: {e}",
                self.worker.base
            )))),
        }
    }

    /// Waits until P's response head arrived (`--sglang-wait-prefill-head`) or P failed.
    async fn wait_head(&mut self) -> Option<LegError> {
        if let Some(head) = self.head.take() {
            if head.await.is_ok() {
                return None;
            }
        }
        self.failure().await
    }
}

/// A prefill worker's 2xx body must be a JSON answer or an event stream without an error
/// event; anything else means its KV cannot be trusted.
fn check_prefill_answer(body: &[u8]) -> Result<(), String> {
    let has_error = |v: &Value| v.get("error").is_some_and(|e| !e.is_null());
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        return match value {
            Value::Object(_) | Value::Array(_) if !has_error(&value) => Ok(()),
            _ => Err(format!(
                "answered 200 with an error or a non-object: {}",
                crate::error::truncate(&String::from_utf8_lossy(body), 512)
            )),
        };
    }
    let mut events = 0;
    for line in body.split(|&b| b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            continue;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) if !has_error(&v) => events += 1,
            Ok(v) => return Err(format!("streamed an error event: {v}")),
            Err(_) => break,
        }
    }
    if events == 0 {
        let text = String::from_utf8_lossy(body);
        return Err(format!(
            "answered 200 with a body that is neither JSON nor an event stream: {}",
            crate::error::truncate(text.trim(), 512)
        ));
    }
    Ok(())
}

/// D's relayed stream with P's outcome attached.
struct Attached {
    relay: Option<BoxStream<'static, Result<Bytes, Infallible>>>,
    /// P, while it has not answered.
    prefill: Option<PrefillLeg>,
    merge: Option<PrefillLogprobs>,
    /// D's `[DONE]` (and anything after it), held until P answered.
    held: Option<Bytes>,
    /// Whether everything sent so far ends at an event boundary.
    at_boundary: bool,
    /// How the stream ends and fails.
    dialect: StreamDialect,
    metrics: Arc<ServingMetrics>,
}

/// What happened next while streaming.
enum Step {
    Prefill(Option<LegError>),
    Relay(Option<Result<Bytes, Infallible>>),
}

impl Attached {
    fn into_stream(self) -> Pin<Box<dyn Stream<Item = Result<Bytes, Infallible>> + Send>> {
        Box::pin(futures::stream::unfold(self, |mut this| async move {
            let chunk = this.next_chunk().await?;
            Some((Ok(chunk), this))
        }))
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if let Some(held) = self.held.take() {
                let failure = match self.prefill.as_mut() {
                    Some(p) => p.failure().await,
                    None => None,
                };
                self.prefill = None;
                return Some(match failure {
                    None => held,
                    Some(e) => self.prefill_failed(e),
                });
            }
            let pending = self.prefill.is_some();
            let step = {
                let relay = self.relay.as_mut()?;
                let prefill = &mut self.prefill;
                tokio::select! {
                    biased;
                    failure = async { prefill.as_mut().expect("pending").failure().await },
                        if pending => Step::Prefill(failure),
                    item = relay.next() => Step::Relay(item),
                }
            };
            let chunk = match step {
                Step::Prefill(None) => {
                    self.prefill = None;
                    continue;
                }
                Step::Prefill(Some(e)) => return Some(self.prefill_failed(e)),
                Step::Relay(None) => {
                    self.relay = None;
                    return None;
                }
                Step::Relay(Some(Ok(chunk))) => chunk,
            };
            let chunk = match &self.merge {
                Some(merge) => merge.merge_events(chunk),
                None => chunk,
            };
            if self.prefill.is_some() {
                if let Some(at) = self.dialect.end_at(&chunk) {
                    if memchr::memmem::find(&chunk[..at], b"data: {\"error\"").is_some() {
                        // D failed: its error ends the stream, and P is no longer needed.
                        self.prefill = None;
                    } else {
                        self.held = Some(chunk.slice(at..));
                        if at == 0 {
                            continue;
                        }
                        let before = chunk.slice(..at);
                        self.at_boundary = ends_event(&before);
                        return Some(before);
                    }
                }
            }
            self.at_boundary = ends_event(&chunk);
            return Some(chunk);
        }
    }

    /// Ends the stream after P failed: D is dropped (its connection closed), and an error
    /// event and `[DONE]` follow what was sent.
    fn prefill_failed(&mut self, e: LegError) -> Bytes {
        self.relay = None;
        self.held = None;
        let message = format!(
            "prefill worker failed after the decode worker started streaming: {}",
            e.failure_message()
        );
        tracing::warn!("{message}");
        let error = if e.kind == LegFault::TimedOut {
            ApiError::gateway_timeout(message)
        } else {
            ApiError::bad_gateway(message)
        };
        self.metrics.inc_stream_errors();
        self.dialect.error_tail(&error, self.at_boundary)
    }
}

fn ends_event(chunk: &[u8]) -> bool {
    chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_answers_are_checked() {
        assert!(check_prefill_answer(br#"{"text":"x","meta_info":{}}"#).is_ok());
        assert!(check_prefill_answer(br#"[{"text":"x"}]"#).is_ok());
        assert!(check_prefill_answer(b"data: {\"a\":1}\n\ndata: [DONE]\n\n").is_ok());
        assert!(check_prefill_answer(b"<html>502 proxy error").is_err());
        assert!(check_prefill_answer(b"").is_err());
        assert!(check_prefill_answer(br#"{"error":{"message":"x"}}"#).is_err());
        assert!(check_prefill_answer(b"data: {\"error\":{\"message\":\"x\"}}\n\n").is_err());
    }

    #[test]
    fn done_is_found_only_at_a_line_start() {
        let done_line = |chunk: &[u8]| StreamDialect::Chat.end_at(chunk);
        assert_eq!(done_line(b"data: {}\n\ndata: [DONE]\n\n"), Some(10));
        assert_eq!(done_line(b"data: [DONE]\n\n"), Some(0));
        assert_eq!(done_line(b"data: {\"t\":\"data: [DONE]\"}\n\n"), None);
        let responses = |chunk: &[u8]| StreamDialect::Responses.end_at(chunk);
        let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"response.completed\"}\n\n";
        assert_eq!(responses(delta), None);
        let mut both = delta.to_vec();
        both.extend_from_slice(
            b"event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
        );
        assert_eq!(responses(&both), Some(delta.len()));
        assert_eq!(
            responses(b"data: {\"type\":\"response.incomplete\",\"response\":{}}\n\n"),
            Some(0)
        );
    }
}
