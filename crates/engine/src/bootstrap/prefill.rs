//! The prefill side of a room: compute the prompt's KV (one token, as SGLang's prefill
//! server answers), publish it under the room's id, and answer only once the decode
//! worker has read it (or an error when none claimed it in time, or its read failed).

use std::sync::Arc;

use pdserve_protocol::{ApiError, KvTransferParams};
use serde_json::Value;

use super::room_id;
use super::Bootstrap;
use crate::kv::PUBLISH_REQUEST_ID;
use crate::request::GenerationRequest;
use crate::serving::{Generation, ServingContext};

/// Opens `room`, submits its prefill and returns the output, which ends only once the
/// room's KV was read (its end waits for that; a room nobody claims in time ends it
/// with a 500 and frees the KV).
pub(crate) async fn submit(
    ctx: &Arc<ServingContext>,
    bootstrap: &Bootstrap,
    room: u64,
    request: GenerationRequest,
    stop: Vec<String>,
) -> Result<Generation, ApiError> {
    let (Some(rooms), Some(service)) = (&bootstrap.rooms, &ctx.kv.service) else {
        return Err(ApiError::bad_request(
            "bootstrap_room was sent to a prefill worker without a bootstrap port \
             (start it with --bootstrap-port)",
        )
        .with_param("bootstrap_room"));
    };
    let id = room_id(room);
    let held = rooms
        .open(room, Some((service.clone(), id.clone())))
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param("bootstrap_room"))?;
    let mut params = KvTransferParams::prefill_request();
    params
        .extra
        .insert(PUBLISH_REQUEST_ID.into(), Value::String(id));
    // On an error here `held` is dropped: the room closes and a waiting read fails.
    let generation = ctx.submit_prefill_for_peer(&params, request, stop).await?;
    let wait = bootstrap.timeout;
    let transferred = async move {
        let result = held.transferred(wait).await;
        drop(held);
        result.map_err(|e| {
            tracing::warn!(room, "{e}");
            ApiError::internal(e.to_string())
        })
    };
    Ok(generation
        .hiding_kv_params()
        .with_companion(Box::pin(transferred)))
}
