//! Sequential handoff with vLLM's `kv_transfer_params` (NIXL-style pull).
//!
//! 1. Prefill leg: the request with `stream=false`, `max_tokens=1`, without
//!    `max_completion_tokens`, `min_tokens` and `stream_options`, and
//!    `kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`
//!    (or, on a conversation's later turn, the previous decode's params so the prefill
//!    worker reads those blocks instead of recomputing the shared prefix).
//! 2. Decode leg: the original request plus the prefill worker's returned params; the
//!    decode worker pulls the blocks and generates.
//!
//! A stream that takes its first token from the prefill leg
//! (`--first-token-from-prefill`, [`crate::legs::first_token`]) sends that token as soon
//! as the prefill leg answered, before the decode leg is even sent (with
//! `--expose-routing`, whose head names the decode worker: once the decode worker
//! answered); the decode stream follows without the token it generates again, and a
//! decode leg that fails after its retries ends the stream with an error event.

use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use pdserve_protocol::{KvTransferParams, WorkerRole};

use super::{RequestContext, X_PDSERVE_PREFILL};
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;
use crate::legs::answer::{expose_worker, forward, FinalLeg};
use crate::legs::first_token::{self, FirstToken};
use crate::legs::prefill::{prefill, prefill_body, PrefillAnswer, ReleaseOnDrop};
use crate::legs::prompt_logprobs::{request_wants_prompt_logprobs, PrefillLogprobs};
use crate::policy::RouteRequest;
use crate::serving::FirstTokenFromPrefill;
use crate::serving::Serving;

/// Runs the prefill leg, then the decode leg.
pub async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    mut request: ClientRequest,
    conversation_id: Option<String>,
    first_token_choice: Option<bool>,
) -> Result<Response, Failure> {
    let mode = state.settings.first_token_from_prefill;
    let early = first_token::eligible(ctx.endpoint, &request, mode, first_token_choice);
    if early {
        first_token::pin_seed(&mut request);
    }
    let turn = TurnPrefill::for_conversation(state, conversation_id.as_deref());
    // A request that cannot fit the model's context is refused before the prefill leg,
    // which asks for one token and would pass, pinning blocks decode then never reads.
    if let Some(max_model_len) = context_limit(state) {
        let known = ctx.prompt_tokens.as_ref().map(|t| t.len() as u64);
        crate::clients::model_len::check(&mut request, max_model_len, known)?;
    }
    let (answer, prefill_worker) = {
        let route = ctx.route_for(&request, conversation_id.as_deref());
        turn.send(state, ctx, &route, |params| prefill_body(&request, params))
            .await?
    };
    let PrefillAnswer {
        kv: handle,
        cached_tokens,
        body: prefill_answer,
    } = answer;
    // The decode worker lists the prompt it imported unscored: P's scores fill it.
    let merge = request_wants_prompt_logprobs(&request)
        .then(|| PrefillLogprobs::from_answer(&prefill_answer));
    // Until decode has answered, P's blocks are released if decode fails or the client
    // leaves (else they stay pinned until the worker's abort timeout).
    let release = ReleaseOnDrop::new(state, &prefill_worker, handle.clone(), &ctx.headers);
    if handle.is_none() {
        tracing::warn!(
            request_id = ctx.headers.request_id(),
            "prefill answered without kv_transfer_params; the decode worker will recompute the prompt"
        );
    }
    request.transport_mut().kv_transfer_params = handle;
    let sent = early
        .then(|| {
            FirstToken::from_answer(
                ctx.endpoint,
                &prefill_answer,
                first_token::choices(&request),
            )
        })
        .flatten()
        .map(Arc::new);
    if early && sent.is_none() {
        let request_id = ctx.headers.request_id();
        let message = "the prefill answer carries no first token; the decode worker's is relayed";
        if mode == FirstTokenFromPrefill::On {
            tracing::warn!(request_id, "{message}");
        } else {
            tracing::debug!(request_id, "{message}");
        }
    }
    let leg = FinalLeg {
        role: WorkerRole::Decode,
        body: request.to_body(),
        stream: request.is_stream(),
        conversation_id: conversation_id.clone(),
        dp_rank: None,
        reencode_on_500: false,
        responses: None,
        first_token: sent.clone(),
    };
    let stream = leg.stream;
    if let Some(sent) = sent
        .clone()
        .filter(|_| stream && ctx.routing_notes.is_none())
    {
        // The client gets P's token now; D's stream follows in the same body. Without
        // `--expose-routing` nothing in the head waits for the decode worker.
        state.metrics.inc_first_token_from_prefill();
        let metrics = state.metrics.clone();
        let state = state.clone();
        let decode_ctx = ctx.clone();
        let decode = async move {
            let ctx = decode_ctx;
            let route = ctx.route_for(&request, conversation_id.as_deref());
            let response = forward(&state, &ctx, &route, leg).await?;
            release.disarm();
            if cached_tokens.is_none() && merge.is_none() {
                return Ok(response);
            }
            Ok(with_prefill_facts(response, true, cached_tokens, merge).await)
        };
        let journey = ctx.journey.clone();
        let mut response = first_token::led_from_prefill(&sent, decode, metrics, journey);
        expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &prefill_worker);
        return Ok(response);
    }
    let route = ctx.route_for(&request, conversation_id.as_deref());
    let mut response = forward(state, ctx, &route, leg).await?;
    // Decode answered: it has read the blocks.
    release.disarm();
    if cached_tokens.is_some() || merge.is_some() {
        response = with_prefill_facts(response, stream, cached_tokens, merge).await;
    }
    if let Some(sent) = sent {
        state.metrics.inc_first_token_from_prefill();
        response = led_by(response, &sent);
    }
    expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &prefill_worker);
    Ok(response)
}

/// The decode worker's stream, led by the prefill leg's first tokens, sent once the
/// decode worker answered (with `--expose-routing`, whose head names the decode worker);
/// the relay takes the decode worker's repeat of them out (the leg's `first_token`).
fn led_by(response: Response, sent: &FirstToken) -> Response {
    let (parts, body) = response.into_parts();
    let head = futures::stream::once(std::future::ready(Ok(sent.events())));
    let body = head.chain(body.into_data_stream());
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// Where a turn's prefill leg starts: from the last turn's decode handle (P reads those
/// blocks, then keeps its own for this turn's D), or from nothing.
pub(crate) struct TurnPrefill {
    params: KvTransferParams,
    from_last_turn: bool,
}

impl TurnPrefill {
    /// Takes the handle kept for conversation `key` (single use), counting the lookup.
    pub(crate) fn for_conversation(state: &Serving, key: Option<&str>) -> Self {
        Self::for_turn(state, key, None)
    }

    /// [`Self::for_conversation`], falling back to `stored`: the handle the history store
    /// kept with the last turn (another gateway replica relayed it).
    pub(crate) fn for_turn(
        state: &Serving,
        key: Option<&str>,
        stored: Option<KvTransferParams>,
    ) -> Self {
        let kept = key.and_then(|id| {
            let kept = state.conversations.take(id).or(stored);
            state.metrics.record_conversation_lookup(kept.is_some());
            kept
        });
        match kept {
            Some(decode_params) => Self {
                params: KvTransferParams {
                    do_remote_decode: true,
                    do_remote_prefill: false,
                    ..decode_params
                },
                from_last_turn: true,
            },
            None => Self {
                params: KvTransferParams::prefill_request(),
                from_last_turn: false,
            },
        }
    }

    /// Sends the prefill leg, its body made by `body` from the params. The last turn's
    /// blocks may be gone (the decode worker restarted, or freed them past its abort
    /// timeout): a server error then sends the turn once more without them, computed in
    /// full, instead of failing the conversation.
    pub(crate) async fn send(
        self,
        state: &Arc<Serving>,
        ctx: &RequestContext,
        route: &RouteRequest<'_>,
        body: impl Fn(KvTransferParams) -> Bytes,
    ) -> Result<(PrefillAnswer, Arc<Worker>), Failure> {
        match prefill(state, ctx, route, body(self.params)).await {
            Err(failure) if self.from_last_turn && failure.status().is_server_error() => {
                tracing::warn!(
                    request_id = ctx.headers.request_id(),
                    status = failure.status().as_u16(),
                    "the prefill leg failed reading the last turn's KV; prefilling the whole prompt"
                );
                state.metrics.record_conversation_fallback();
                let fresh = body(KvTransferParams::prefill_request());
                prefill(state, ctx, route, fresh).await
            }
            answer => answer,
        }
    }
}

/// The smallest context length known among the live decode and prefill workers (their
/// `/v1/models` is fetched on first sight; until then no check).
pub(crate) fn context_limit(state: &Arc<Serving>) -> Option<u64> {
    let roster = state.registry.snapshot();
    [WorkerRole::Decode, WorkerRole::Prefill]
        .into_iter()
        .flat_map(|role| roster.live(role).iter())
        .filter_map(|worker| state.model_lens.get(&state.client, worker))
        .min()
}

/// What the prefill leg knows goes into D's answer: the client's usage reports the
/// prefill leg's `cached_tokens` (prefix-cache hits where the prompt was computed), as
/// vllm-router does (the decode side's count is not about this prompt's computation),
/// and P's prompt logprobs fill D's. Non-stream: the body; stream: its events.
async fn with_prefill_facts(
    response: Response,
    stream: bool,
    cached: Option<u64>,
    merge: Option<PrefillLogprobs>,
) -> Response {
    if !response.status().is_success() {
        return response;
    }
    let (parts, body) = response.into_parts();
    if stream {
        let events = body.into_data_stream().map(move |chunk| {
            chunk.map(|mut c| {
                if let Some(cached) = cached {
                    c = crate::legs::sse::stream_with_cached_tokens(c, cached);
                }
                match &merge {
                    Some(merge) => merge.merge_events(c),
                    None => c,
                }
            })
        });
        return Response::from_parts(parts, axum::body::Body::from_stream(events));
    }
    // The non-stream body is already in memory (read whole by the final leg).
    let mut bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(bytes) => bytes,
        Err(_) => return Response::from_parts(parts, axum::body::Body::empty()),
    };
    if let Some(rewritten) = cached.and_then(|c| crate::legs::sse::with_cached_tokens(&bytes, c)) {
        bytes = Bytes::from(rewritten);
    }
    if let Some(merge) = &merge {
        bytes = merge.merge_body(bytes);
    }
    Response::from_parts(parts, axum::body::Body::from(bytes))
}
