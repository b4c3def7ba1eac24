//! What every handler shares: the serving context and what only the HTTP side needs.

use std::sync::Arc;

use crate::bootstrap::Bootstrap;
use crate::health::WorkerHealth;
use crate::orchestrator::Orchestrator;
use crate::serving::ServingContext;

/// What every handler shares.
pub struct AppState {
    /// The engine and what submitting to it needs.
    pub serving: Arc<ServingContext>,
    /// What `GET /health` reports.
    pub health: Arc<WorkerHealth>,
    /// With `--prefill`: runs each request's prefill on a prefill worker first.
    pub orchestrator: Option<Arc<Orchestrator>>,
    /// SGLang's protocol: role, bootstrap rooms, what `/server_info` reports.
    pub bootstrap: Bootstrap,
    /// Stored Responses-API responses (`GET /v1/responses/{id}`, `previous_response_id`).
    pub responses: Arc<super::response_store::ResponseStore>,
}
