//! The embedded CPU engine behind `pdserve worker`: a GGUF model over a paged KV cache
//! with prefix caching and continuous batching, served with the OpenAI API.

pub mod block_manager;
pub mod metrics;
pub mod request;
pub mod sampling;
pub mod scheduler;
mod sequence;
pub mod step_model;

/// `pdserve worker` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{0}")]
    Other(String),
}

/// Runs a worker until Ctrl-C.
pub async fn run(_args: WorkerArgs) -> Result<(), WorkerError> {
    Err(WorkerError::Other("the worker is not built yet".into()))
}
