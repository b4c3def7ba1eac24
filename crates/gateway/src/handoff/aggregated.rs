//! Aggregated serving: one worker does prefill and decode; the request passes through.

use std::sync::Arc;

use axum::response::Response;
use pdserve_protocol::WorkerRole;

use super::final_leg::{forward, FinalLeg};
use super::RequestContext;
use crate::error::Failure;
use crate::state::AppState;
use crate::validation::GenerateRequest;

/// Sends the client's request (without `conversation_id`) to a prefill_decode worker.
pub async fn serve(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    request: GenerateRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    let route = ctx.route_for(&request, conversation_id.as_deref());
    let leg = FinalLeg {
        role: WorkerRole::PrefillDecode,
        body: request.to_body(),
        stream: request.is_stream(),
        // An aggregated worker keeps its own prefix cache; there is no KV to hand over.
        conversation_id: None,
    };
    forward(state, ctx, &route, leg).await
}
