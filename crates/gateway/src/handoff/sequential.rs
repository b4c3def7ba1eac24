//! Sequential handoff with vLLM's `kv_transfer_params` (NIXL-style pull).
//!
//! 1. Prefill leg: the request with `stream=false`, `max_tokens=1`, without
//!    `max_completion_tokens`, `min_tokens` and `stream_options`, and
//!    `kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`
//!    (or, on a conversation's later turn, the previous decode's params so the prefill
//!    worker reads those blocks instead of recomputing the shared prefix).
//! 2. Decode leg: the original request plus the prefill worker's returned params; the
//!    decode worker pulls the blocks and generates.

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use bytes::Bytes;
use pdserve_protocol::{KvTransferParams, WorkerRole};
use serde_json::Value;

use super::final_leg::{expose_worker, forward, FinalLeg};
use super::retry::{with_retries, Leg};
use super::{RequestContext, X_PDSERVE_PREFILL};
use crate::error::Failure;
use crate::policy::{RequestOutcome, RouteRequest};
use crate::registry::Worker;
use crate::state::AppState;
use crate::upstream::{Exchange, LegError, LegErrorKind};
use crate::validation::GenerateRequest;

/// Runs the prefill leg, then the decode leg.
pub async fn serve(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    mut request: GenerateRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    let cached = conversation_id.as_deref().map(|id| {
        let cached = state.conversations.take(id);
        state.metrics.record_conversation_lookup(cached.is_some());
        cached
    });
    let prefill_params = match cached.flatten() {
        // P reads D's blocks from the last turn, then keeps its own for this turn's D.
        Some(decode_params) => KvTransferParams {
            do_remote_decode: true,
            do_remote_prefill: false,
            ..decode_params
        },
        None => KvTransferParams::prefill_request(),
    };
    let body = prefill_body(&request, prefill_params);
    let (handle, prefill_worker) = {
        let route = ctx.route_for(&request, conversation_id.as_deref());
        prefill(state, ctx, &route, body).await?
    };
    if handle.is_none() {
        tracing::warn!(
            request_id = ctx.headers.request_id(),
            "prefill answered without kv_transfer_params; the decode worker will recompute the prompt"
        );
    }
    request.transport_mut().kv_transfer_params = handle;
    let leg = FinalLeg {
        role: WorkerRole::Decode,
        body: request.to_body(),
        stream: request.is_stream(),
        conversation_id: conversation_id.clone(),
        dp_rank: None,
        reencode_on_500: false,
    };
    let route = ctx.route_for(&request, conversation_id.as_deref());
    let mut response = forward(state, ctx, &route, leg).await?;
    if state.config.expose_routing {
        expose_worker(&mut response, X_PDSERVE_PREFILL, &prefill_worker);
    }
    Ok(response)
}

/// The prefill leg's body: one token, not streamed, asking P to keep its blocks for D.
pub fn prefill_body(request: &GenerateRequest, params: KvTransferParams) -> Bytes {
    let mut prefill = request.clone();
    let transport = prefill.transport_mut();
    transport.stream = Some(false);
    transport.stream_options = None;
    transport.kv_transfer_params = Some(params);
    let generation = prefill.generation_mut();
    generation.max_tokens = Some(1);
    generation.max_completion_tokens = None;
    generation.min_tokens = None;
    prefill.to_body()
}

/// Sends the prefill leg (retried on fresh prefill workers before anything reached the
/// client) and returns the `kv_transfer_params` P answered with, and P.
async fn prefill(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    body: Bytes,
) -> Result<(Option<KvTransferParams>, Arc<Worker>), Failure> {
    with_retries(
        state,
        ctx,
        route,
        WorkerRole::Prefill,
        Leg::Prefill,
        |worker| {
            let body = body.clone();
            async move { prefill_once(state, ctx, &worker, body, worker.next_dp_rank()).await }
        },
    )
    .await
}

/// Sends the prefill leg once, to `worker` naming `rank` (the consumer the encoders
/// published to), and returns the `kv_transfer_params` it answered with; the caller
/// decides about retries.
pub async fn prefill_pinned(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    worker: &Arc<Worker>,
    body: Bytes,
    rank: Option<u32>,
) -> Result<Option<KvTransferParams>, LegError> {
    prefill_once(state, ctx, worker, body, rank)
        .await
        .inspect_err(|e| state.report(worker, e))
}

async fn prefill_once(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    worker: &Arc<Worker>,
    body: Bytes,
    rank: Option<u32>,
) -> Result<Option<KvTransferParams>, LegError> {
    let mut in_flight = state.start_request(worker.clone());
    let sent = Instant::now();
    let exchange = Exchange::new(worker, "prefill worker", state.config.prefill_timeout);
    let request = state
        .upstream
        .post_leg_at(worker, ctx.endpoint, body, &ctx.headers, rank);
    let result = async {
        let body = exchange.send_and_read(request).await?;
        state.metrics.observe_prefill(sent.elapsed());
        parse_prefill_answer(&body).map_err(|why| exchange.error(LegErrorKind::Status, why))
    }
    .await;
    in_flight.set_outcome(match &result {
        Ok(_) => RequestOutcome::Success,
        Err(e) if e.is_worker_fault() => RequestOutcome::Failure,
        Err(_) => RequestOutcome::Other,
    });
    result
}

/// The `kv_transfer_params` of a prefill worker's 200 answer.
fn parse_prefill_answer(body: &[u8]) -> Result<Option<KvTransferParams>, String> {
    let mut answer: Value = serde_json::from_slice(body)
        .map_err(|e| format!("answered 200 with a body that is not JSON: {e}"))?;
    let Some(object) = answer.as_object_mut() else {
        return Err("answered 200 with a body that is not a JSON object".into());
    };
    match object.remove("kv_transfer_params") {
        None | Some(Value::Null) => Ok(None),
        Some(params) => serde_json::from_value(params)
            .map(Some)
            .map_err(|e| format!("answered malformed kv_transfer_params: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use serde_json::json;

    #[test]
    fn prefill_body_has_vllm_shape() {
        let (req, _) = GenerateRequest::parse(
            Endpoint::Chat,
            json!({
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": 50,
                "max_completion_tokens": 60,
                "min_tokens": 5,
                "temperature": 0.5,
                "vendor_field": [1]
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let body: Value =
            serde_json::from_slice(&prefill_body(&req, KvTransferParams::prefill_request()))
                .unwrap();
        assert_eq!(body["stream"], false);
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["vendor_field"], json!([1]));
        for dropped in ["max_completion_tokens", "min_tokens", "stream_options"] {
            assert!(body.get(dropped).is_none(), "{dropped} must be dropped");
        }
        assert_eq!(
            body["kv_transfer_params"],
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null
            })
        );
    }
}
