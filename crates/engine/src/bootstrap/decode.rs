//! The decode side of a room: read the room's KV from the prefill worker's bootstrap
//! port (the read waits there for the prefill), then decode here.

use std::sync::Arc;

use pdserve_protocol::{ApiError, BootstrapParams};

use super::{room_id, Bootstrap, BOOTSTRAP_ENGINE_ID};
use crate::kv::import::use_pulled_prompt_kv;
use crate::kv::pull::{pull_blocks, KvPeer, RemoteBlocks};
use crate::request::GenerationRequest;
use crate::serving::{Generation, ServingContext};

/// Reads the room `fields` name into `request` (bounded by `--bootstrap-timeout-secs`:
/// 504 past it, 502 when the prefill worker refuses or fails the read) and submits it.
pub(crate) async fn submit(
    ctx: &Arc<ServingContext>,
    bootstrap: &Bootstrap,
    fields: &BootstrapParams,
    mut request: GenerationRequest,
    stop: Vec<String>,
) -> Result<Generation, ApiError> {
    let Some(port) = fields.bootstrap_port.filter(|&p| p != 0) else {
        return Err(ApiError::bad_request(
            "bootstrap_port is required with bootstrap_room on a decode worker",
        )
        .with_param("bootstrap_port"));
    };
    if fields.bootstrap_host.is_empty() {
        return Err(ApiError::bad_request(
            "bootstrap_host is required with bootstrap_room on a decode worker",
        )
        .with_param("bootstrap_host"));
    }
    let room = fields.bootstrap_room;
    let peer = KvPeer {
        host: fields.bootstrap_host.clone(),
        port,
        engine_id: BOOTSTRAP_ENGINE_ID.into(),
    };
    let remote = RemoteBlocks::awaited(&peer, room_id(room), request.prompt.len(), &ctx.kv.layout);
    let timeout = bootstrap.timeout;
    let metrics = &ctx.metrics.bootstrap;
    let pulled =
        match tokio::time::timeout(timeout, pull_blocks(&ctx.kv, remote, &request.prompt)).await {
            Ok(Ok(pulled)) => pulled,
            Ok(Err(e)) => {
                metrics.rendezvous("failed");
                return Err(e.into());
            }
            Err(_) => {
                metrics.rendezvous("timeout");
                return Err(ApiError::gateway_timeout(format!(
                    "no KV for bootstrap_room {room} from {}:{port} within {} s",
                    fields.bootstrap_host,
                    timeout.as_secs()
                )));
            }
        };
    if let Err(e) = use_pulled_prompt_kv(&ctx.kv, pulled, &mut request) {
        metrics.rendezvous("failed");
        return Err(e.into());
    }
    metrics.rendezvous("ok");
    ctx.generate(request, stop)
}
