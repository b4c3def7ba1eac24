//! How a generation request crosses the workers: one module per handoff protocol, and
//! the encoder stage in front of them for requests with media items.

pub mod aggregated;
pub mod bootstrap;
pub mod bootstrap_merge;
pub mod conditional;
pub mod encode;
pub mod epd;
pub mod final_leg;
pub mod media;
pub mod mm_rewrite;
pub mod prefill_leg;
pub mod relay;
pub mod retry;
pub mod sequential;
pub mod sglang_route;

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use http::HeaderMap;
use pdserve_protocol::{ApiError, WorkerRole};

use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::policy::RouteRequest;
use crate::registry::Mode;
use crate::request::ClientRequest;
use crate::state::AppState;
use crate::worker_client::ForwardHeaders;

/// With `--expose-routing`: the prefill worker that served the request.
pub const X_PDSERVE_PREFILL: &str = "x-pdserve-prefill";
/// With `--expose-routing`: the decode worker that served the request.
pub const X_PDSERVE_DECODE: &str = "x-pdserve-decode";
/// With `--expose-routing`: the prefill_decode worker that served the request.
pub const X_PDSERVE_WORKER: &str = "x-pdserve-worker";

/// Per-request facts every leg needs.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The OpenAI endpoint, used for the worker URL.
    pub endpoint: Endpoint,
    /// The route label for metrics.
    pub route: &'static str,
    /// Headers sent on every leg.
    pub headers: ForwardHeaders,
    /// The client's headers, for routing policies.
    pub client_headers: HeaderMap,
    /// When the client request arrived.
    pub started: Instant,
}

impl RequestContext {
    /// The context of a request to `route` that arrived now with the client's `headers`.
    pub fn new(endpoint: Endpoint, route: &'static str, headers: HeaderMap) -> Self {
        Self {
            endpoint,
            route,
            headers: ForwardHeaders::from_client(&headers),
            client_headers: headers,
            started: Instant::now(),
        }
    }

    /// The routing facts of `request`.
    pub fn route_for<'a>(
        &'a self,
        request: &'a ClientRequest,
        conversation_id: Option<&'a str>,
    ) -> RouteRequest<'a> {
        RouteRequest {
            endpoint: self.endpoint,
            request: Some(request),
            headers: &self.client_headers,
            conversation_id,
        }
    }
}

/// Serves a validated request with the handoff the configured pools allow; a chat
/// request with media items goes through the encoders first.
pub async fn generate(
    state: &Arc<AppState>,
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
    if matches!(&request, ClientRequest::Chat(chat) if media::has_media(chat)) {
        return epd::serve(state, ctx, request, conversation_id).await;
    }
    let roster = state.registry.snapshot();
    match roster.routing_mode() {
        Mode::Disaggregated => {
            let route = ctx.route_for(&request, conversation_id.as_deref());
            if conditional::skips_prefill(state, &roster, &route) {
                state.metrics.record_disaggregation("prefill_skipped");
                // The decode worker's final KV handle still serves the conversation's next
                // turn, as after a handoff.
                return aggregated::serve(state, ctx, request, conversation_id, WorkerRole::Decode)
                    .await;
            }
            state.metrics.record_disaggregation("disaggregated");
            if state.config.protocol == crate::args::Protocol::Sglang {
                return bootstrap::serve(state, ctx, request, conversation_id).await;
            }
            sequential::serve(state, ctx, request, conversation_id).await
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
        Mode::Unavailable => Err(ApiError::service_unavailable(format!(
            "no worker can serve this request: {}",
            roster.missing().join("; ")
        ))
        .into()),
    }
}
