//! The decode leg of a P/D request (`do_remote_prefill: true`): load the prompt's KV
//! from the prefill worker instead of computing it.
//!
//! Every prompt position but the last is imported; the last prompt token is computed
//! here, as the prefix cache always does, so the first token comes from this worker's
//! own logits and greedy output is token for token the aggregated one. A request that
//! starts from the prefill worker's own first token (`GenerationRequest::first_token`)
//! imports the whole prompt, as far as the peer holds it, and computes that token's
//! position instead.

use pdserve_kv_transfer::PulledBlocks;
use pdserve_model::BLOCK_SIZE;
use pdserve_protocol::KvTransferParams;

use super::pull::{pull_blocks, RemoteBlocks};
use super::{HandoffError, KvContext};
use crate::request::{GenerationRequest, KvImport};

/// Pulls the prompt's KV named by `params` into `request.kv_import`. The pull always
/// runs to the end (so the prefill worker frees its blocks) even when there is nothing
/// to import. A peer whose KV does not cover the prompt is an error.
pub async fn import_prompt_kv(
    kv: &KvContext,
    params: &KvTransferParams,
    request: &mut GenerationRequest,
) -> Result<(), HandoffError> {
    let remote = RemoteBlocks::from_params(params, &kv.layout)?;
    let pulled = pull_blocks(kv, remote, &request.prompt).await?;
    use_pulled_prompt_kv(kv, pulled, request)
}

/// Loads `pulled` (a peer's KV for `request`'s prompt) into `request.kv_import`; a peer
/// whose KV does not cover the prompt is an error.
pub fn use_pulled_prompt_kv(
    kv: &KvContext,
    pulled: PulledBlocks,
    request: &mut GenerationRequest,
) -> Result<(), HandoffError> {
    let needed = request.prompt.len() - 1;
    if pulled.matched_tokens < needed {
        return Err(HandoffError::PromptNotCovered {
            covered: pulled.matched_tokens,
            prompt_tokens: request.prompt.len(),
        });
    }
    let most = needed + usize::from(request.first_token.is_some());
    let taken = pulled.matched_tokens.min(most);
    if taken == 0 {
        return Ok(());
    }
    let mut blocks = pulled.blocks;
    blocks.truncate(taken.div_ceil(BLOCK_SIZE));
    kv.metrics.kv.imported_tokens.inc_by(taken as u64);
    request.kv_import = Some(KvImport {
        num_tokens: taken,
        blocks,
        // What the prefill worker did not compute either (its prefix-cache hits, an
        // earlier turn's KV) is cached for this request; the rest was computed there.
        reused: pulled.reused.within(taken),
        landed_at: Some(pulled.received_at),
    });
    Ok(())
}
