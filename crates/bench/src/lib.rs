//! `pdserve bench`: serving benchmarks for any OpenAI-compatible endpoint.

/// `pdserve bench` subcommands and flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {}

/// Errors that stop a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Other(String),
}

/// Runs a benchmark command.
pub async fn run(_args: BenchArgs) -> Result<(), BenchError> {
    Err(BenchError::Other("the benchmark is not built yet".into()))
}
