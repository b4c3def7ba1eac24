//! KV handoff between workers: what a request's `kv_transfer_params` ask of this worker,
//! importing a peer's prompt KV (decode side), exporting this worker's KV for a peer
//! (prefill side), pulling blocks over TCP, and the service that serves published blocks.

mod export;
pub mod handoff;
mod import;
pub mod pull;
pub mod service;
