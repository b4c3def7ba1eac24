//! The prefill leg of a P/D request (`do_remote_decode: true`): compute the prompt's KV
//! (one token, as vLLM does) and keep it pinned for the decode worker.
//!
//! On a conversation's later turn the params also name the blocks the last turn's decode
//! worker kept (prompt and output); the shared prefix is read from there and only the new
//! suffix is computed. That read is an optimisation: if it fails, the prompt is computed
//! here in full.

use pdserve_protocol::KvTransferParams;

use pdserve_model::BLOCK_SIZE;

use super::pull::{pull_blocks, RemoteBlocks};
use super::KvContext;
use crate::request::{GenerationRequest, KvImport};

/// Turns `request` into a one-token prefill whose blocks stay pinned, importing a
/// previous turn's shared prefix when `params` name one.
pub async fn prepare_prefill(
    kv: &KvContext,
    params: &KvTransferParams,
    request: &mut GenerationRequest,
) {
    request.max_new_tokens = 1;
    request.min_new_tokens = 0;
    request.pin_on_finish = true;
    if !RemoteBlocks::named_by(params) {
        return;
    }
    let remote = match RemoteBlocks::from_params(params, &kv.layout) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("ignoring an incomplete KV handle; computing the prompt: {e}");
            return;
        }
    };
    let pulled = match pull_blocks(kv, remote, &request.prompt).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("reusing the conversation's KV failed; computing the prompt: {e}");
            return;
        }
    };
    // The last prompt token is always computed here (it yields the logits).
    let reused = pulled.matched_tokens.min(request.prompt.len() - 1);
    if reused == 0 {
        return;
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
    });
}
