//! `pdserve bench`: serving benchmarks for any OpenAI-compatible endpoint (pdserve,
//! vLLM, SGLang, a router): TTFT, TPOT, ITL, end-to-end latency, throughput and
//! goodput, multi-turn prefix-cache reuse, JSON results and SVG plots.

mod arg_values;
pub mod args;
pub mod client;
pub mod compare;
pub mod dataset;
pub mod load;
pub mod metrics;
pub mod multi_turn;
pub mod plot;
pub mod priority;
pub mod priority_report;
mod progress;
pub mod report;
pub mod responses_client;
pub mod schedule;
pub mod serve;
pub mod trace;
pub mod trace_gen;
pub mod trace_prompt;
pub mod workload;

use std::path::PathBuf;

pub use args::{BenchArgs, BenchCommand, CompareArgs, MultiTurnArgs, ServeArgs};
pub use report::{BenchResult, SCHEMA_VERSION};
pub use trace_gen::TraceGenArgs;

/// Errors that stop a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `--url` is not a usable URL.
    #[error("invalid --url `{url}`: {reason}")]
    BadUrl {
        /// What was given.
        url: String,
        /// Why it is unusable.
        reason: String,
    },
    /// No TCP connection to the server.
    #[error("cannot reach {url}: {reason} (is the server running, and is --url right?)")]
    Unreachable {
        /// The server's base URL.
        url: String,
        /// The connection error.
        reason: String,
    },
    /// The server answered, but not as an OpenAI-compatible API.
    #[error("{url} is not an OpenAI-compatible API: {reason}")]
    NotOpenAi {
        /// The URL that answered.
        url: String,
        /// What was wrong with the answer.
        reason: String,
    },
    /// `GET /v1/models` listed nothing.
    #[error("{0} lists no models; pass --model")]
    NoModels(String),
    /// The probe request before the run failed.
    #[error("the first request to {url} failed: {reason}")]
    ProbeFailed {
        /// The endpoint URL.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// `--tokenizer-gguf` could not be loaded or used.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The HTTP client could not be built or used.
    #[error("HTTP client error: {0}")]
    Http(String),
    /// A result or plot file could not be read or written.
    #[error("{}: {reason}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A result could not be serialized.
    #[error("cannot serialize the result: {0}")]
    Json(String),
    /// A request task panicked.
    #[error("a request task failed: {0}")]
    Task(String),
    /// Ctrl-C stopped the run (the partial results were printed).
    #[error("interrupted; partial results above")]
    Interrupted,
    /// A trace (`--dataset-path`) could not be read or has a bad line.
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    /// Every request failed (the reasons were printed).
    #[error("all {0} requests failed; see the failure reasons above")]
    AllFailed(u64),
    /// `--tokenize-prompt` with an endpoint that takes no token ids.
    #[error("--tokenize-prompt sends prompts as token ids, which only /v1/completions takes; use --endpoint completions")]
    TokenIdsNeedCompletions,
}

/// Resolves on Ctrl-C; never, if the signal handler cannot be installed.
async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Prints the table and writes the JSON and plot files a run asked for.
pub fn emit(result: &BenchResult, output: &args::OutputArgs) -> Result<(), BenchError> {
    print!("{}", result.table());
    if let Some(path) = &output.result_json {
        result.write_json(path)?;
        tracing::info!(path = %path.display(), "results written");
    }
    if let Some(path) = &output.plot {
        plot::write_plot(path, &[(result.label.clone(), result)])?;
        tracing::info!(path = %path.display(), "plot written");
    }
    if result.interrupted {
        return Err(BenchError::Interrupted);
    }
    if result.summary.completed == 0 && result.summary.failed > 0 {
        return Err(BenchError::AllFailed(result.summary.failed));
    }
    Ok(())
}

/// Runs a benchmark command.
pub async fn run(args: BenchArgs) -> Result<(), BenchError> {
    match args.command {
        BenchCommand::Serve(args) => {
            let result = serve::run_serve(&args, ctrl_c()).await?;
            emit(&result, &args.output)
        }
        BenchCommand::MultiTurn(args) => {
            let result = multi_turn::run_multi_turn(&args, ctrl_c()).await?;
            emit(&result, &args.output)
        }
        BenchCommand::Compare(args) => compare::run_compare(&args),
        BenchCommand::TraceGen(args) => trace_gen::run_trace_gen(&args),
    }
}
