//! One worker prefills and decodes: a prefill_decode worker, or a decode worker when the
//! prefill leg is skipped; the request passes through.

use std::sync::Arc;

use axum::response::Response;
use pdserve_protocol::WorkerRole;

use super::RequestContext;
use crate::error::Failure;
use crate::ingress::request::ClientRequest;
use crate::legs::answer::{forward, FinalLeg};
use crate::serving::Serving;

/// Sends the client's request (without `conversation_id`) to one worker of `role` that
/// prefills and decodes it: a prefill_decode worker, or a decode worker when conditional
/// disaggregation skips the prefill leg. `conversation_id` routes (session affinity); only
/// a decode worker's final KV handle is kept for the conversation's next turn.
pub async fn serve(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: ClientRequest,
    conversation_id: Option<String>,
    role: WorkerRole,
) -> Result<Response, Failure> {
    let mut route = ctx.route_for(&request, conversation_id.as_deref());
    route.local_prefill = role == WorkerRole::Decode;
    let leg = FinalLeg {
        role,
        body: request.to_body(),
        stream: request.is_stream(),
        // A prefill_decode worker keeps its own prefix cache; there is no KV to hand over.
        conversation_id: conversation_id
            .clone()
            .filter(|_| role == WorkerRole::Decode),
        dp_rank: None,
        reencode_on_500: false,
        first_token: None,
        responses: None,
    };
    forward(state, ctx, &route, leg).await
}
