//! What a request's `kv_transfer_params` ask of this worker: import a peer's KV, keep
//! this request's KV for a peer, or nothing.

use std::sync::Arc;

use pdserve_protocol::{ApiError, KvTransferParams};

use crate::api::generation::Generation;
use crate::kv::service::PublishKind;
use crate::kv::import::import_prompt_kv;
use crate::kv::export::prepare_prefill;
use crate::request::GenerationRequest;
use crate::api::server::AppState;

/// Applies `params` to `request` (pulling a peer's blocks where they say so) and returns
/// how the finished request's blocks are to be published, if at all.
pub async fn apply(
    app: &AppState,
    params: Option<&KvTransferParams>,
    request: &mut GenerationRequest,
) -> Result<Option<PublishKind>, ApiError> {
    let Some(params) = params else {
        return Ok(None);
    };
    match (params.do_remote_decode, params.do_remote_prefill) {
        (true, true) => Err(ApiError::bad_request(
            "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
        )
        .with_param("kv_transfer_params")),
        (false, true) => {
            import_prompt_kv(app, params, request).await?;
            // Keep the conversation's KV for its next turn's prefill.
            request.pin_on_finish = app.kv_service.is_some();
            Ok(request.pin_on_finish.then_some(PublishKind::Conversation))
        }
        (true, false) => {
            if app.kv_service.is_none() {
                tracing::warn!(
                    "do_remote_decode asked of a worker without a KV transfer service \
                     (start it with --kv-port); serving the request in full"
                );
                return Ok(None);
            }
            prepare_prefill(app, params, request).await;
            Ok(Some(PublishKind::Prefill))
        }
        // Nothing asked (e.g. a decode worker's hand-back echoed back as is).
        (false, false) => Ok(None),
    }
}

/// Applies `params` to `request`, submits it, and returns its output, which publishes
/// the finished request's blocks where `params` ask for that.
pub async fn submit(
    app: &Arc<AppState>,
    params: Option<&KvTransferParams>,
    mut request: GenerationRequest,
    stop: Vec<String>,
) -> Result<Generation, ApiError> {
    let publish = apply(app, params, &mut request).await?;
    // A prefill for a peer must end with its one token, never be cut by a stop string
    // (that cancels the sequence and its blocks with it).
    let stop = if publish == Some(PublishKind::Prefill) {
        Vec::new()
    } else {
        stop
    };
    let prompt_tokens = request.prompt.len();
    let events = app.submit(request)?;
    Ok(Generation::new(app.clone(), events, prompt_tokens, stop).publishing(publish))
}
