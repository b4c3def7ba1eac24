//! Encoder disaggregation, as vLLM's EPD proxy: a request with media items is encoded on
//! encode workers first ([`encode`]), rewritten to reference the published embeddings
//! ([`mm_rewrite`]), then served by the usual handoff: a prefill and a decode worker
//! (E+P+D) or one prefill_decode worker (E+PD), whichever the roster has.
//!
//! The stage that consumes the embeddings (prefill in E+P+D, the prefill_decode worker in
//! E+PD) is chosen before encoding, with one data-parallel rank named both to it and to
//! the encoders (push connectors deliver to that replica). A failure of that stage, or a
//! decode 500, before the first byte reached the client redoes the whole attempt from
//! the original request (encode again, then a fresh consumer); another decode failure
//! retries the decode leg alone on another decode worker, the prefill's KV kept. One
//! loop, one budget: `1 + --max-retries` attempts in all, with backoff between them.
//!
//! [`encode`]: crate::encoder
//! [`mm_rewrite`]: crate::encoder::mm_rewrite

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::Response;
use pdserve_protocol::{ApiError, ChatCompletionRequest, KvTransferParams, WorkerRole};

use super::{RequestContext, X_PDSERVE_PREFILL};
use crate::clients::worker_client::LegError;
use crate::encoder::media::{extract, MediaItem};
use crate::encoder::mm_rewrite::{merge_ec_params, rewrite};
use crate::encoder::{encode, Encoded};
use crate::error::Failure;
use crate::fleet::registry::{Mode, Roster, Worker};
use crate::ingress::request::ClientRequest;
use crate::legs::answer::{expose_worker, forward_once, FinalLeg};
use crate::legs::prefill::{prefill_body, prefill_pinned, ReleaseOnDrop};
use crate::legs::retry::RetryBudget;
use crate::serving::Serving;

/// Stage durations of one attempt.
#[derive(Debug, Default)]
struct Stages {
    encode: Duration,
    rewrite: Duration,
    prefill: Option<Duration>,
    decode_ttfb: Duration,
}

/// Serves a chat request that has media items (`request` must be a chat request).
pub async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: ClientRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    let ClientRequest::Chat(chat) = &request else {
        return Err(ApiError::internal("media items outside a chat request").into());
    };
    let items = extract(chat);
    let roster = state.registry.snapshot();
    let consumer_role = match roster.routing_mode() {
        Mode::Disaggregated => WorkerRole::Prefill,
        Mode::Aggregated => WorkerRole::PrefillDecode,
        Mode::Unavailable => {
            return Err(state
                .registry
                .refuse_unservable("no worker can serve this request")
                .into())
        }
    };
    if roster.routable(WorkerRole::Encode).workers.is_empty() {
        return Err(ApiError::service_unavailable(no_encoder(&roster, &items)).into());
    }
    let mode = if consumer_role == WorkerRole::Prefill {
        "e_p_d"
    } else {
        "e_pd"
    };
    state.metrics.record_disaggregation(mode);
    let route = ctx.route_for(&request, conversation_id.as_deref());
    // A conversation's previous decode KV serves the first attempt's prefill only.
    let mut cached = match (&conversation_id, consumer_role) {
        (Some(id), WorkerRole::Prefill) => {
            let cached = state.conversations.take(id);
            state.metrics.record_conversation_lookup(cached.is_some());
            cached
        }
        _ => None,
    };
    let mut budget = RetryBudget::new(state);
    let mut consumers: Vec<Arc<Worker>> = Vec::new();
    // Set while a prefill's KV is pinned for this request: a decode failure other than a
    // 500 retries only the decode leg, on another decode worker.
    let mut prefilled: Option<Prefilled> = None;
    let mut last: Option<LegError> = None;
    while budget.take().await {
        let attempt = budget.used();
        if let Some(previous) = &last {
            let again = if prefilled.is_some() {
                "decode leg"
            } else {
                "request from its encoder stage"
            };
            tracing::warn!(
                request_id = ctx.headers.request_id(),
                attempt,
                reason = crate::clients::worker_client::fault_label(previous.kind),
                "retrying the {again}: {}",
                previous.failure_message()
            );
        }
        let mut current = match prefilled.take() {
            Some(current) => current,
            None => {
                if last.is_some() {
                    state.metrics.inc_encoder_reencodes();
                }
                // A fresh consumer each time while there is one; else the same again (a
                // decode 500 is usually the embedding, not the worker).
                let consumer = state
                    .pick(consumer_role, &consumers, &route)
                    .or_else(|| state.pick(consumer_role, &[], &route))
                    .ok_or_else(|| state.refuse(consumer_role))?;
                consumers.push(consumer.clone());
                let rank = consumer.next_dp_rank();
                let consumer_zmq = consumer
                    .spec
                    .ec_zmq_addrs
                    .get(rank.unwrap_or(0) as usize)
                    .map(String::as_str);
                let mut stages = Stages::default();
                let started = Instant::now();
                let encoded = encode(state, ctx, chat, &items, consumer_zmq).await?;
                stages.encode = started.elapsed();
                let rewritten = Instant::now();
                let prepared = prepare(state, chat, &items, &encoded);
                stages.rewrite = rewritten.elapsed();
                if consumer_role == WorkerRole::PrefillDecode {
                    // E+PD: the consumer prefills and decodes (pinned to it).
                    let leg = FinalLeg {
                        role: WorkerRole::PrefillDecode,
                        body: prepared.to_body(),
                        stream: prepared.is_stream(),
                        // A prefill_decode worker keeps its own prefix cache.
                        conversation_id: None,
                        dp_rank: rank,
                        reencode_on_500: true,
                        first_token: None,
                        responses: None,
                    };
                    let started = Instant::now();
                    match forward_once(state, ctx, &leg, &consumer).await {
                        Ok(response) => {
                            stages.decode_ttfb = started.elapsed();
                            record(state, ctx, mode, &items, &encoded, &stages, attempt);
                            return Ok(response);
                        }
                        Err(e) if e.retryable() || e.escalated => {
                            last = Some(e);
                            continue;
                        }
                        Err(e) => return Err(e.failure),
                    }
                }
                // E+P+D: the consumer prefills (pinned to it), then a decode worker.
                let params = match cached.take() {
                    Some(decode_params) => KvTransferParams {
                        do_remote_decode: true,
                        do_remote_prefill: false,
                        ..decode_params
                    },
                    None => KvTransferParams::prefill_request(),
                };
                let mut prepared = prepared;
                let body = prefill_body(&prepared, params);
                let started = Instant::now();
                let handle = match prefill_pinned(state, ctx, &consumer, body, rank).await {
                    Ok(handle) => handle,
                    Err(e) if e.retryable() || e.escalated => {
                        last = Some(e);
                        continue;
                    }
                    Err(e) => return Err(e.failure),
                };
                stages.prefill = Some(started.elapsed());
                // As in the plain P/D handoff: a failed decode (or a client gone first)
                // frees the consumer's pinned blocks at once, not at its abort timeout.
                let release = ReleaseOnDrop::new(state, &consumer, handle.clone(), &ctx.headers);
                prepared.transport_mut().kv_transfer_params = handle;
                Prefilled {
                    body: prepared,
                    release,
                    prefill: consumer,
                    encoded,
                    stages,
                    decode_tried: Vec::new(),
                }
            }
        };
        // The decode leg of E+P+D: a worker this prefill has not failed on yet.
        let Some(decode) = state.pick(WorkerRole::Decode, &current.decode_tried, &route) else {
            return Err(match last {
                Some(e) => e.failure,
                None => state.refuse(WorkerRole::Decode).into(),
            });
        };
        current.decode_tried.push(decode.clone());
        let leg = FinalLeg {
            role: WorkerRole::Decode,
            body: current.body.to_body(),
            stream: current.body.is_stream(),
            conversation_id: conversation_id.clone(),
            dp_rank: None,
            reencode_on_500: true,
            first_token: None,
            responses: None,
        };
        let started = Instant::now();
        match forward_once(state, ctx, &leg, &decode).await {
            Ok(mut response) => {
                current.release.disarm();
                current.stages.decode_ttfb = started.elapsed();
                expose_worker(&mut response, ctx, X_PDSERVE_PREFILL, &current.prefill);
                record(
                    state,
                    ctx,
                    mode,
                    &items,
                    &current.encoded,
                    &current.stages,
                    attempt,
                );
                return Ok(response);
            }
            // A 500: the embedding could not be fetched; the whole request is redone
            // (dropping `current` releases the prefill's KV).
            Err(e) if e.escalated => last = Some(e),
            Err(e) if e.retryable() => {
                state
                    .metrics
                    .inc_retries("decode", crate::clients::worker_client::fault_label(e.kind));
                last = Some(e);
                prefilled = Some(current);
            }
            Err(e) => return Err(e.failure),
        }
    }
    Err(match last {
        Some(e) => e.failure,
        None => ApiError::service_unavailable("no attempt could be made").into(),
    })
}

/// An E+P+D request whose prefill is done: what its decode leg needs, kept across decode
/// retries.
struct Prefilled {
    /// The decode leg's body, carrying the prefill's KV handle.
    body: ClientRequest,
    /// Releases the prefill's KV unless a decode answered.
    release: ReleaseOnDrop,
    prefill: Arc<Worker>,
    encoded: Encoded,
    stages: Stages,
    /// Decode workers that failed this prefill's decode leg.
    decode_tried: Vec<Arc<Worker>>,
}

/// Why a media request cannot be served, in words.
fn no_encoder(roster: &Roster, items: &[MediaItem<'_>]) -> String {
    let mut kinds: Vec<&str> = items.iter().map(|i| i.kind.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let registered = roster
        .members()
        .iter()
        .filter(|m| m.worker.role() == WorkerRole::Encode)
        .count();
    let why = if registered == 0 {
        "no encode worker is registered (start the gateway with --encode URL, or register \
         one with POST /instances {\"role\": \"encode\", ...})"
            .to_string()
    } else {
        format!("no healthy encode worker (all {registered} are evicted)")
    };
    format!(
        "this request has {} media item(s) ({}) to encode, but {why}",
        items.len(),
        kinds.join(", ")
    )
}

/// The body for the prefill/decode workers: the rewritten request (or the original with
/// `--no-rewrite`) carrying the encoders' connector handles. The original is untouched,
/// so a retry encodes the raw media again.
fn prepare(
    state: &Serving,
    chat: &ChatCompletionRequest,
    items: &[MediaItem<'_>],
    encoded: &Encoded,
) -> ClientRequest {
    let rewritten = if state.settings.no_rewrite {
        None
    } else {
        rewrite(chat, items, &encoded.reports)
    };
    let mut out = rewritten.unwrap_or_else(|| chat.clone());
    if !encoded.handles.is_empty() {
        merge_ec_params(&mut out.extra, encoded.handles.clone());
    }
    ClientRequest::Chat(out)
}

/// Stage metrics and the per-request debug line.
fn record(
    state: &Serving,
    ctx: &RequestContext,
    mode: &str,
    items: &[MediaItem<'_>],
    encoded: &Encoded,
    stages: &Stages,
    attempt: usize,
) {
    let total = ctx.started.elapsed();
    ctx.journey.encoded(if stages.prefill.is_some() {
        crate::observe::request_record::Mode::EncodePrefillDecode
    } else {
        crate::observe::request_record::Mode::EncodePrefillDecodeTogether
    });
    let metrics = &state.metrics;
    metrics.observe_epd_stage("encode", stages.encode);
    metrics.observe_epd_stage("rewrite", stages.rewrite);
    if let Some(prefill) = stages.prefill {
        metrics.observe_epd_stage("prefill", prefill);
    }
    metrics.observe_epd_stage("decode_ttfb", stages.decode_ttfb);
    metrics.observe_epd_stage("total", total);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    tracing::debug!(
        request_id = ctx.headers.request_id(),
        mode,
        rewrite = !state.settings.no_rewrite,
        items = items.len(),
        sub_requests = encoded.sub_requests,
        attempt,
        encode_ms = ms(stages.encode),
        rewrite_ms = ms(stages.rewrite),
        prefill_ms = stages.prefill.map(ms),
        decode_ttfb_ms = ms(stages.decode_ttfb),
        total_ms = ms(total),
        "epd stages"
    );
}
