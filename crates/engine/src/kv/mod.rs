//! KV handoff between workers: what a request's `kv_transfer_params` ask of this worker,
//! importing a peer's prompt KV (decode side), exporting this worker's KV for a peer
//! (prefill side), pulling blocks over TCP, and the service that serves published blocks.
//! Failures are [`HandoffError`]s; nothing here knows about HTTP.

use std::sync::Arc;

use crate::metrics::Metrics;

mod error;
mod export;
pub mod handoff;
mod import;
pub mod pull;
pub mod service;

pub use error::HandoffError;
pub use service::{KvService, KvServiceConfig, PublishKind};

/// What KV handoff needs of its worker.
#[derive(Debug)]
pub struct KvContext {
    /// The KV block format peers must share (`KvStore::layout`).
    pub layout: String,
    /// Bytes in one KV block.
    pub block_bytes: usize,
    /// Transfer counters live here.
    pub metrics: Arc<Metrics>,
    /// The KV transfer service, when this worker runs one (prefill and decode roles).
    pub service: Option<Arc<KvService>>,
}
