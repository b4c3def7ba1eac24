//! KV handoff between workers: what a request's `kv_transfer_params` ask of this worker,
//! importing a peer's prompt KV (decode side), exporting this worker's KV for a peer
//! (prefill side), pulling blocks over TCP, and the service that serves published blocks.
//! Failures are [`HandoffError`]s; nothing here knows about HTTP.

use std::sync::Arc;

use pdserve_kv_transfer::{PeerAllowList, TransferSecret};

use crate::metrics::Metrics;

mod error;
pub mod export;
pub mod import;
pub mod pull;
pub mod service;
mod sim_link;

pub use error::HandoffError;
pub use service::awaited::{ExpectedPublication, AWAITED_BLOCK};
pub use service::{KvService, KvServiceConfig, PublishKind};
pub use sim_link::SimulatedLink;

pub use pdserve_protocol::kv::PUBLISH_REQUEST_ID;

/// How the blocks a finished request leaves pinned are to be published.
#[derive(Debug)]
pub struct Publish {
    /// Why they are published.
    pub kind: PublishKind,
    /// The reader-chosen id to publish under, when there is one.
    pub name: Option<ExpectedPublication>,
}

impl Publish {
    /// Publication as `kind` under an id of this worker's own.
    pub fn unnamed(kind: PublishKind) -> Self {
        Self { kind, name: None }
    }
}

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
    /// Hosts this worker reads KV from and serves KV to (`--kv-peers`).
    pub peers: Arc<PeerAllowList>,
    /// The shared transfer secret (`PDSERVE_KV_SECRET`), when configured.
    pub secret: Option<TransferSecret>,
    /// With `--sim`: the link a pull takes the time of.
    pub link: Option<SimulatedLink>,
}
