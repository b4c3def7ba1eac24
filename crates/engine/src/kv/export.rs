//! The prefill leg of a P/D request (`do_remote_decode: true`): compute the prompt's KV
//! (one token, as vLLM does) and keep it pinned for the decode worker.
//!
//! On a conversation's later turn the params also name the blocks the last turn's decode
//! worker kept (prompt and output); the shared prefix is read from there and only the new
//! suffix is computed. That read is an optimisation: if it fails, the prompt is computed
//! here in full.

use std::sync::Arc;

use pdserve_kv_transfer::ReusedTokens;
use pdserve_protocol::KvTransferParams;
use serde_json::Value;

use pdserve_model::BLOCK_SIZE;

use super::pull::{pull_blocks, RemoteBlocks};
use super::{ExpectedPublication, HandoffError, KvContext, KvService, PUBLISH_REQUEST_ID};
use crate::request::{GenerationRequest, KvImport};

/// Turns `request` into a one-token prefill whose blocks stay pinned, importing a
/// previous turn's shared prefix when `params` name one. Returns the announced
/// reader-chosen id to publish under, when the params carry one.
pub async fn prepare_prefill(
    kv: &KvContext,
    service: &Arc<KvService>,
    params: &KvTransferParams,
    request: &mut GenerationRequest,
) -> Result<Option<ExpectedPublication>, HandoffError> {
    // Announced first: a reader waiting for it must learn as early as possible that this
    // prefill is on its way (or, by the guard's drop, that it failed).
    let name = match params.extra.get(PUBLISH_REQUEST_ID) {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() => Some(
            service
                .expect(id, &request.prompt)
                .map_err(|e| HandoffError::BadPublishId(e.to_string()))?,
        ),
        Some(other) => {
            return Err(HandoffError::BadPublishId(format!(
                "expected a non-empty string, got {other}"
            )))
        }
    };
    request.max_new_tokens = 1;
    request.min_new_tokens = 0;
    request.pin_on_finish = true;
    request.copy_on_finish = true;
    // Its reader may be waiting already: the blocks go to it as they are computed.
    request.kv_feed = name.as_ref().map(|n| n.feed().clone());
    if RemoteBlocks::named_by(params) {
        import_conversation_prefix(kv, params, request).await?;
    }
    Ok(name)
}

/// Loads the shared prefix of a previous turn's KV that `params` name, if it can. Only
/// a peer outside `--kv-peers` is an error; any other failure (the blocks are gone, the
/// peer is down) just means the prompt is computed here.
async fn import_conversation_prefix(
    kv: &KvContext,
    params: &KvTransferParams,
    request: &mut GenerationRequest,
) -> Result<(), HandoffError> {
    let remote = match RemoteBlocks::from_params(params, &kv.layout) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("ignoring an incomplete KV handle; computing the prompt: {e}");
            return Ok(());
        }
    };
    let pulled = match pull_blocks(kv, remote, &request.prompt).await {
        Ok(p) => p,
        Err(e @ HandoffError::PeerNotAllowed { .. }) => return Err(e),
        Err(e) => {
            tracing::warn!("reusing the conversation's KV failed; computing the prompt: {e}");
            return Ok(());
        }
    };
    // The last prompt token is always computed here (it yields the logits).
    let reused = pulled.matched_tokens.min(request.prompt.len() - 1);
    if reused == 0 {
        return Ok(());
    }
    let mut blocks = pulled.blocks;
    blocks.truncate(reused.div_ceil(BLOCK_SIZE));
    kv.metrics.kv.imported_tokens.inc_by(reused as u64);
    tracing::debug!(
        reused,
        prompt = request.prompt.len(),
        "conversation prefix read from its decode worker"
    );
    request.kv_import = Some(KvImport {
        num_tokens: reused,
        blocks,
        // All of it was computed by earlier turns, none for this request.
        reused: ReusedTokens {
            prefix_cache_tokens: 0,
            earlier_turn_tokens: reused,
        },
        // Not a decode's wait for its prompt: the prefill side reading its own prefix.
        landed_at: None,
    });
    Ok(())
}
