//! How a generation request crosses the workers: one module per handoff protocol (the
//! modes), each composed of the legs in [`crate::legs`]; requests with media items go
//! through the encoder stage ([`crate::encoder`]) first.

pub mod aggregated;
pub mod batch;
pub mod bootstrap;
pub mod conditional;
pub mod epd;
pub mod intake;
pub mod prewarm;
pub mod sequential;
pub mod sglang_route;
pub mod shed;

use std::sync::Arc;

use axum::response::Response;
use pdserve_protocol::WorkerRole;

use crate::error::Failure;
use crate::fleet::registry::Mode;
use crate::ingress::request::ClientRequest;
use crate::serving::Serving;

pub use crate::legs::{RequestContext, X_PDSERVE_DECODE, X_PDSERVE_PREFILL, X_PDSERVE_WORKER};

/// Serves a validated request with the handoff the configured pools allow; a chat
/// request with media items goes through the encoders first.
pub async fn generate(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    mut request: ClientRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    // Only the gateway writes SGLang's bootstrap fields: a client's would make a decode
    // worker connect to any host and port it names.
    let transport = request.transport_mut();
    transport.bootstrap_host = None;
    transport.bootstrap_port = None;
    transport.bootstrap_room = None;
    let first_token = crate::legs::first_token::take_request_choice(&mut request);
    if matches!(&request, ClientRequest::Chat(chat) if crate::encoder::media::has_media(chat)) {
        return epd::serve(state, ctx, request, conversation_id).await;
    }
    let roster = state.registry.snapshot();
    match roster.routing_mode() {
        Mode::Disaggregated => {
            if let Some(prompts) = batch::split(&request) {
                // Each prompt is routed on its own (the gateway's tokens were the first's).
                let ctx = &RequestContext {
                    prompt_tokens: None,
                    ..ctx.clone()
                };
                return batch::serve(prompts, batch::Parts::Prompts, |_, one| {
                    disaggregated(state, ctx, one, None, first_token)
                })
                .await;
            }
            disaggregated(state, ctx, request, conversation_id, first_token).await
        }
        Mode::Aggregated => {
            state.metrics.record_disaggregation("aggregated");
            aggregated::serve(
                state,
                ctx,
                request,
                conversation_id,
                WorkerRole::PrefillDecode,
            )
            .await
        }
        Mode::Unavailable => Err(state
            .registry
            .refuse_unservable("no worker can serve this request")
            .into()),
    }
}

/// Serves one request through P/D, with the protocol configured (or on the decode
/// worker alone when the prefill can be skipped). `first_token`: the request's own
/// choice about its first token from the prefill leg.
async fn disaggregated(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: ClientRequest,
    conversation_id: Option<String>,
    first_token: Option<bool>,
) -> Result<Response, Failure> {
    let roster = state.registry.snapshot();
    let route = ctx.route_for(&request, conversation_id.as_deref());
    if let Some(turn) = conditional::skips_prefill(state, &roster, &route) {
        state.metrics.record_disaggregation("prefill_skipped");
        // The decode worker's final KV handle still serves the conversation's next
        // turn, as after a handoff.
        let answer =
            aggregated::serve(state, ctx, request, conversation_id, WorkerRole::Decode).await;
        // Its answer has started: the prompt is computed.
        drop(turn);
        return answer;
    }
    state.metrics.record_disaggregation("disaggregated");
    if state.settings.protocol == crate::serving::Protocol::Sglang {
        return bootstrap::serve(state, ctx, request, conversation_id, first_token).await;
    }
    if let Some(choices) = batch::split_choices(&request) {
        // vLLM's decode reads a handle once per choice: one P/D pair per choice. The
        // conversation continues from the first choice.
        return batch::serve(choices, batch::Parts::Choices, |i, one| {
            let conversation_id = conversation_id.clone().filter(|_| i == 0);
            sequential::serve(state, ctx, one, conversation_id, first_token)
        })
        .await;
    }
    sequential::serve(state, ctx, request, conversation_id, first_token).await
}
