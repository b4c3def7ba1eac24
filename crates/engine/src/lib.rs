//! The embedded CPU engine behind `pdserve worker`.

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
