//! The embedded CPU engine behind `pdserve worker`: a GGUF model over a paged KV cache
//! with prefix caching and continuous batching, served with the OpenAI API.

// `pdserve_protocol::ApiError` (status + OpenAI body) is ~150 bytes; it is only built on
// the request-rejection path, where moving it costs nothing that matters.
#![allow(clippy::result_large_err)]
#![warn(missing_docs)]

pub mod api;
pub mod args;
pub mod block_manager;
pub mod bootstrap;
pub mod compute;
pub mod handoff;
pub mod health;
pub mod heartbeat;
pub mod kv;
pub mod kv_events;
pub mod kv_feed;
pub mod metrics;
pub mod orchestrator;
pub mod output_text;
pub mod profile;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod scheduling;
mod sequence;
pub mod serving;
pub mod sim;
pub mod step_model;
pub mod step_shape;
pub mod trace;
pub mod worker;

pub use args::WorkerArgs;
pub use pdserve_protocol::WorkerRole;
pub use worker::{run, Worker, WorkerError};
