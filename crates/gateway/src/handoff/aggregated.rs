//! Aggregated serving: one worker does prefill and decode; the request passes through.

use std::sync::Arc;

use axum::response::Response;

use super::final_leg::{forward, FinalLeg};
use super::RequestContext;
use crate::error::Failure;
use crate::registry::Role;
use crate::server::AppState;
use crate::validation::GenerateRequest;

/// Sends the client's request (without `conversation_id`) to an aggregated worker.
pub async fn serve(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    request: GenerateRequest,
) -> Result<Response, Failure> {
    let leg = FinalLeg {
        pool: &state.registry.aggregated,
        role: Role::Aggregated,
        body: request.to_body(),
        stream: request.is_stream(),
        // An aggregated worker keeps its own prefix cache; there is no KV to hand over.
        conversation_id: None,
    };
    forward(state, ctx, leg).await
}
