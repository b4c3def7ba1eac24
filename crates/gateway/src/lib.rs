//! The OpenAI-compatible gateway behind `pdserve gateway`.
//!
//! Clients speak the OpenAI API; the gateway routes each request across a live registry
//! of prefill, decode and prefill_decode workers (static flags, or registered at run time
//! through the admin API; health-probed, evicted and re-admitted), moving the KV cache
//! from prefill to decode with vLLM's `kv_transfer_params` protocol and reusing a
//! conversation's decode KV on its next turn. Requests with image, audio or video items
//! are encoded on encode workers first and reach prefill/decode as metadata references
//! (vLLM's E+P+D and E+PD).

pub mod clients;
pub mod config;
pub mod encoder;
pub mod endpoint;
pub mod error;
pub mod flags;
pub mod fleet;
pub mod handoff;
pub mod ingress;
pub mod legs;
pub mod observe;
pub mod planner;
pub mod policy;
pub mod responses;
pub mod routes;
pub mod server;
pub mod serving;
pub mod sessions;
pub mod state;

pub use config::{GatewayArgs, GatewayConfig};
pub use error::GatewayError;
pub use server::{router, run, serve};
