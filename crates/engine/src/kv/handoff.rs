//! What a request's `kv_transfer_params` ask of this worker: import a peer's KV, keep
//! this request's KV for a peer, or nothing.

use pdserve_protocol::KvTransferParams;

use super::export::prepare_prefill;
use super::import::import_prompt_kv;
use super::{HandoffError, KvContext, Publish, PublishKind};
use crate::request::GenerationRequest;

/// Applies `params` to `request` (pulling a peer's blocks where they say so) and returns
/// how the finished request's blocks are to be published, if at all.
pub async fn prepare(
    kv: &KvContext,
    params: Option<&KvTransferParams>,
    request: &mut GenerationRequest,
) -> Result<Option<Publish>, HandoffError> {
    let Some(params) = params else {
        return Ok(None);
    };
    match (params.do_remote_decode, params.do_remote_prefill) {
        (true, true) => Err(HandoffError::ConflictingDirections),
        (false, true) => {
            import_prompt_kv(kv, params, request).await?;
            // Keep the conversation's KV for its next turn's prefill.
            request.pin_on_finish = kv.service.is_some();
            Ok(request
                .pin_on_finish
                .then(|| Publish::unnamed(PublishKind::Conversation)))
        }
        (true, false) => {
            let Some(service) = &kv.service else {
                tracing::warn!(
                    "do_remote_decode asked of a worker without a KV transfer service \
                     (start it with --kv-port); serving the request in full"
                );
                return Ok(None);
            };
            let name = prepare_prefill(kv, service, params, request).await?;
            Ok(Some(Publish {
                kind: PublishKind::Prefill,
                name,
            }))
        }
        // Nothing asked (e.g. a decode worker's hand-back echoed back as is).
        (false, false) => Ok(None),
    }
}
