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

use std::sync::{Arc, Mutex};

use axum::response::Response;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use pdserve_protocol::{ApiError, WorkerRole};
use serde_json::{Map, Value};
use tokio::sync::oneshot;

mod attached;
mod led;
mod leg;
mod prefill_leg;

use attached::Attached;
use led::{DecodeStart, Led};
use leg::{decode_exchange_error, final_error, leg_request, reported};
use prefill_leg::PrefillLeg;

use super::sglang_route::wants_input_logprobs;
pub use super::sglang_route::{SglangRoute, GENERATE_ROUTE};
use crate::clients::worker_client::LegError;
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::request::{append_verbatim, ClientRequest};
use crate::legs::answer::{
    expose_worker, json_response, relay, start_answer, stream_response, AnswerStart, BodyShape,
};
use crate::legs::first_token;
use crate::legs::first_token_watch::FirstTokenWatch;
use crate::legs::prompt_logprobs::PrefillLogprobs;
use crate::legs::retry::{with_retries, Leg};
use crate::legs::sse::{edit_response_body, split_kv_params, AnswerSink, ResponseObjects};
use crate::legs::{RequestContext, X_PDSERVE_DECODE, X_PDSERVE_PREFILL};
use crate::policy::{RequestOutcome, RouteRequest};
use crate::serving::Serving;

/// Serves a validated chat or completion request with SGLang's bootstrap handoff.
pub async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    mut request: ClientRequest,
    conversation_id: Option<String>,
    first_token_choice: Option<bool>,
) -> Result<Response, Failure> {
    let route = match ctx.endpoint {
        Endpoint::Chat => SglangRoute::Chat,
        Endpoint::Completions => SglangRoute::Completions,
        Endpoint::Responses => SglangRoute::Responses,
    };
    // P streams its one token at once and ends once D read the KV: that token can lead
    // the answer (one choice; with --expose-routing the head waits to name D).
    let mode = state.settings.first_token_from_prefill;
    let lead = route != SglangRoute::Responses
        && ctx.routing_notes.is_none()
        && first_token::choices(&request) == 1
        && first_token::eligible(ctx.endpoint, &request, mode, first_token_choice);
    if lead {
        first_token::pin_seed(&mut request);
    }
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
    let plan = Plan::new(route, body, verbatim, None, lead);
    run(state, ctx, &plan, &routing).await
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
    /// P's streamed first token leads the answer when it comes before D's head.
    lead: bool,
}

impl Plan {
    fn new(
        route: SglangRoute,
        body: Map<String, Value>,
        verbatim: Vec<(String, String)>,
        responses: Option<Arc<dyn ResponseObjects>>,
        lead: bool,
    ) -> Self {
        let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
        Self {
            route,
            verbatim,
            responses,
            stream,
            input_logprobs: wants_input_logprobs(route, &body),
            lead: lead && stream,
            body,
        }
    }
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
    let plan = Plan::new(route, body, verbatim, responses, false);
    run(state, ctx, &plan, routing).await
}

/// Runs `plan`'s attempts.
async fn run(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    plan: &Plan,
    routing: &RouteRequest<'_>,
) -> Result<Response, Failure> {
    // Decode workers that failed this request; prefill workers are tracked by the retry
    // loop, which drives the pair choice.
    let failed_decode = Mutex::new(Vec::new());
    let (response, _prefill) = with_retries(
        state,
        ctx,
        routing,
        WorkerRole::Prefill,
        Leg::Prefill,
        |prefill| attempt(state, ctx, plan, routing, prefill, &failed_decode),
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
    let (watch, mut first_token) = match plan.route.endpoint().filter(|_| plan.lead) {
        Some(endpoint) => {
            let (tx, rx) = oneshot::channel();
            (Some(FirstTokenWatch::new(endpoint, tx)), Some(rx))
        }
        None => (None, None),
    };
    let mut p_leg = PrefillLeg::spawn(state, ctx, plan.route, prefill.clone(), prefill_body, watch);
    let mut d_in_flight = state.start_request(decode.clone());
    let d_span = crate::observe::trace::leg(ctx.trace.as_ref(), "decode", &decode, &decode.base);
    // Owned, so that a stream led by P's token can finish it inside the answer's body.
    let mut decode_start: DecodeStart = {
        let (state, ctx, decode) = (state.clone(), ctx.clone(), decode.clone());
        let (route, stream, d_leg) = (plan.route, plan.stream, d_span.clone());
        Box::pin(async move {
            let request = leg_request(&state, &ctx, route, &decode, decode_body, d_leg.as_ref())
                .map_err(|why| decode_exchange_error(&state, &decode, why))?;
            let started = start_answer(
                &state,
                &decode,
                "decode worker",
                request,
                stream,
                BodyShape::ObjectOrArray,
            )
            .await;
            if !matches!(started, Ok(AnswerStart::Stream(_))) {
                crate::observe::trace::leg_done(d_leg.clone(), &started);
            }
            started
        })
    };
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
            token = async { first_token.as_mut().expect("guarded").await },
                if first_token.is_some() => {
                first_token = None;
                if let Ok(sent) = token {
                    let led = Led { sent, decode, prefill, decode_start, p_leg, d_in_flight, d_span };
                    return Ok(led.into_response(state, ctx));
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
            let tokens = ctx.prompt_tokens.as_deref();
            if let Some(Some(p_error)) = p_leg.failure().now_or_never() {
                // No KV ever came: D computed nothing either.
                state.forget_unsent(&decode, tokens, &p_error);
                return Err(p_error);
            }
            if e.is_worker_fault() {
                d_in_flight.set_outcome(RequestOutcome::Failure);
            }
            state.report(&decode, &e);
            state.forget_unsent(&decode, tokens, &e);
            if p_leg.is_pending() {
                // P's leg ends with this attempt (aborted below), its prompt not computed
                // for this request either.
                state.forget_unsent(&prefill, tokens, &e);
            }
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
                Some(objects) => {
                    let body = edit_response_body(body, objects.as_ref(), &decode.base);
                    objects.flush().await;
                    body
                }
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
