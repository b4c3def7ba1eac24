//! How a generation request crosses the workers: one module per handoff protocol.

pub mod aggregated;
pub mod final_leg;
pub mod relay;
pub mod sequential;

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use pdserve_protocol::ApiError;

use crate::error::Failure;
use crate::registry::{Endpoint, Mode};
use crate::server::AppState;
use crate::upstream::ForwardHeaders;
use crate::validation::GenerateRequest;

/// Per-request facts every leg needs.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The OpenAI endpoint, used for the worker URL.
    pub endpoint: Endpoint,
    /// The route label for metrics.
    pub route: &'static str,
    /// Headers sent on every leg.
    pub headers: ForwardHeaders,
    /// When the client request arrived.
    pub started: Instant,
}

/// Serves a validated request with the handoff the configured pools allow.
pub async fn generate(
    state: &Arc<AppState>,
    ctx: &RequestContext,
    request: GenerateRequest,
    conversation_id: Option<String>,
) -> Result<Response, Failure> {
    match state.registry.mode() {
        Mode::Disaggregated => sequential::serve(state, ctx, request, conversation_id).await,
        Mode::Aggregated => aggregated::serve(state, ctx, request).await,
        Mode::Unavailable => {
            let missing: Vec<_> = state
                .registry
                .missing_roles()
                .iter()
                .map(|r| r.as_str())
                .collect();
            Err(ApiError::service_unavailable(format!(
                "no worker can serve this request: no {} worker is configured",
                missing.join(" / ")
            ))
            .into())
        }
    }
}
