//! Command-line flags of `pdserve bench` and its subcommands.

use std::path::PathBuf;

use clap::{Args, FromArgMatches, Subcommand, ValueEnum};

use crate::arg_values::{checked_args, positive_ms, positive_seconds, range_ratio};
pub use crate::load::Dataset;
use crate::load::Load;
use crate::priority::{PriorityClass, PriorityMix};
use crate::trace_gen::TraceGenArgs;

/// `pdserve bench` subcommands and flags.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Which benchmark to run.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// The benchmarks.
#[derive(Debug, Clone, Subcommand)]
pub enum BenchCommand {
    /// Load test: N synthetic streaming requests at a fixed concurrency or a Poisson
    /// request rate, or a Mooncake-format trace replayed at its timestamps; reports TTFT,
    /// TPOT, ITL, end-to-end latency, throughput, goodput and the bench's own lateness.
    Serve(ServeArgs),
    /// Conversations that grow turn by turn (each prompt carries the previous answers):
    /// per-turn TTFT and the share of prompt tokens the server reports as cached.
    MultiTurn(MultiTurnArgs),
    /// Side-by-side table (ratios against the first file) and an optional SVG plot of
    /// result files written with `--result-json`.
    Compare(CompareArgs),
    /// Write a synthetic trace in Mooncake's format (for `serve --dataset mooncake`):
    /// Poisson arrivals with optional bursts, shared prefixes of Zipf-distributed
    /// popularity, and multi-turn sessions whose prompts grow turn by turn.
    TraceGen(TraceGenArgs),
}

/// The endpoint a benchmark sends its requests to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (the prompt becomes one user message).
    Chat,
    /// `POST /v1/completions` (the prompt is sent as is, so its length is exact).
    Completions,
}

impl Endpoint {
    /// The request path under the server's base URL.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }
}

/// Where the server is and how to talk to it.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000 (a trailing
    /// `/v1` is accepted). Repeat it (comma-separated in the environment variable) to
    /// spread the load over gateway replicas: `serve` sends request i to URL i mod n,
    /// `multi-turn` keeps conversation c on URL c mod n.
    #[arg(
        long,
        env = "PDSERVE_BENCH_URL",
        required = true,
        value_delimiter = ','
    )]
    pub url: Vec<String>,
    /// Model name to request; default: the first id listed by `GET /v1/models`.
    #[arg(long, env = "PDSERVE_BENCH_MODEL")]
    pub model: Option<String>,
    /// Bearer token sent as `Authorization: Bearer <key>`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Seconds to wait for a TCP connection before the server counts as unreachable.
    #[arg(long, env = "PDSERVE_BENCH_CONNECT_TIMEOUT_S", default_value_t = 5.0, value_parser = positive_seconds)]
    pub connect_timeout_s: f64,
    /// Seconds one request may take from sending to its last byte.
    #[arg(long, env = "PDSERVE_BENCH_REQUEST_TIMEOUT_S", default_value_t = 600.0, value_parser = positive_seconds)]
    pub request_timeout_s: f64,
    /// Do not send `ignore_eos: true` (a vLLM/SGLang extension that fixes the output
    /// length; servers that reject unknown fields need this).
    #[arg(long, env = "PDSERVE_BENCH_NO_IGNORE_EOS")]
    pub no_ignore_eos: bool,
    /// GGUF file of the served model: its tokenizer sizes prompts exactly (default: an
    /// approximation of one token per common word, exact for SmolLM2 and GPT-style BPE).
    #[arg(long, env = "PDSERVE_BENCH_TOKENIZER_GGUF")]
    pub tokenizer_gguf: Option<PathBuf>,
}

/// Service-level objectives for goodput.
#[derive(Debug, Clone, Default, Args)]
pub struct SloArgs {
    /// SLO on time to first token, in ms; with `--slo-tpot-ms`, goodput counts the
    /// completed requests per second that meet every SLO given (DistServe's metric).
    #[arg(long, env = "PDSERVE_BENCH_SLO_TTFT_MS", value_parser = positive_ms)]
    pub slo_ttft_ms: Option<f64>,
    /// SLO on time per output token after the first, in ms (see `--slo-ttft-ms`).
    #[arg(long, env = "PDSERVE_BENCH_SLO_TPOT_MS", value_parser = positive_ms)]
    pub slo_tpot_ms: Option<f64>,
}

/// Where results go.
#[derive(Debug, Clone, Default, Args)]
pub struct OutputArgs {
    /// Write the full results (config, summary, every request) as JSON to this file;
    /// the schema is documented in crates/bench/README.md.
    #[arg(long, env = "PDSERVE_BENCH_RESULT_JSON")]
    pub result_json: Option<PathBuf>,
    /// Write an SVG plot (latency CDFs and output throughput over time) to this file.
    #[arg(long, env = "PDSERVE_BENCH_PLOT")]
    pub plot: Option<PathBuf>,
    /// Name of this run in the result file and in `compare` (default: the model name).
    #[arg(long, env = "PDSERVE_BENCH_LABEL")]
    pub label: Option<String>,
}

/// `--num-prompts` of `serve` when it is not given (random prompts).
pub const DEFAULT_NUM_PROMPTS: u64 = 100;

/// `pdserve bench serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where the server is and how to talk to it.
    #[command(flatten)]
    pub server: ServerArgs,
    /// Number of requests to send (default: 100). With `--dataset mooncake`: replay only
    /// the trace's first N requests (default: all of them).
    #[arg(long, env = "PDSERVE_BENCH_NUM_PROMPTS", value_parser = clap::value_parser!(u64).range(1..))]
    pub num_prompts: Option<u64>,
    /// The pacing (`--concurrency`, `--request-rate` or a trace's timestamps) and the
    /// prompts (`--dataset`, `--dataset-path`, `--trace-speedup`).
    #[command(flatten)]
    pub load: Load,
    /// Prompt length in tokens (approximate, see `--endpoint`; the server's `usage` gives
    /// the exact count, which is what the report uses).
    #[arg(long, env = "PDSERVE_BENCH_INPUT_LEN", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub input_len: u64,
    /// Output length in tokens (`max_tokens`, with `ignore_eos` unless `--no-ignore-eos`).
    #[arg(long, env = "PDSERVE_BENCH_OUTPUT_LEN", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub output_len: u64,
    /// Spread of lengths: each request's input and output length is drawn uniformly
    /// from [len * (1 - r), len * (1 + r)].
    #[arg(long, env = "PDSERVE_BENCH_RANGE_RATIO", default_value_t = 0.0, value_parser = range_ratio)]
    pub range_ratio: f64,
    /// Seed for prompts, lengths and arrival times (same seed, same benchmark).
    #[arg(long, env = "PDSERVE_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
    /// API to call: `completions` sends the prompt as is; `chat` wraps it in one user
    /// message (the chat template adds a few tokens).
    #[arg(long, env = "PDSERVE_BENCH_ENDPOINT", value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Send each prompt as token ids (a completions `prompt` of integers, as SGLang's
    /// bench_serving `--tokenize-prompt` does), so the servers tokenize nothing: a replay
    /// of long prompts then measures serving, not tokenizing them at the gateway and again
    /// at each worker. Needs `--tokenizer-gguf` (the served model's) and `--endpoint
    /// completions`.
    #[arg(
        long,
        env = "PDSERVE_BENCH_TOKENIZE_PROMPT",
        requires = "tokenizer_gguf"
    )]
    pub tokenize_prompt: bool,
    /// shared-prefix: groups, each with its own system prompt.
    #[arg(long, env = "PDSERVE_BENCH_GSP_NUM_GROUPS", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub gsp_num_groups: u64,
    /// shared-prefix: prompts per group.
    #[arg(long, env = "PDSERVE_BENCH_GSP_PROMPTS_PER_GROUP", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub gsp_prompts_per_group: u64,
    /// shared-prefix: tokens of each group's system prompt.
    #[arg(long, env = "PDSERVE_BENCH_GSP_SYSTEM_PROMPT_LEN", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub gsp_system_prompt_len: u64,
    /// shared-prefix: tokens of each question.
    #[arg(long, env = "PDSERVE_BENCH_GSP_QUESTION_LEN", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub gsp_question_len: u64,
    /// shared-prefix: tokens of each answer.
    #[arg(long, env = "PDSERVE_BENCH_GSP_OUTPUT_LEN", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub gsp_output_len: u64,
    /// `--priority`: the share of requests sending each `priority` value.
    #[command(flatten)]
    pub priority: PriorityMix,
    /// SLOs for goodput.
    #[command(flatten)]
    pub slo: SloArgs,
    /// Result file, plot and label.
    #[command(flatten)]
    pub output: OutputArgs,
}

impl ServeArgs {
    /// `--num-prompts`, or its default for random prompts.
    pub fn num_prompts_or_default(&self) -> u64 {
        self.num_prompts.unwrap_or(DEFAULT_NUM_PROMPTS)
    }
}

/// `pdserve bench multi-turn`.
#[derive(Debug, Clone, Args)]
pub struct MultiTurnArgs {
    /// Where the server is and how to talk to it.
    #[command(flatten)]
    pub server: ServerArgs,
    /// Number of conversations.
    #[arg(long, env = "PDSERVE_BENCH_CONVERSATIONS", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub conversations: u64,
    /// Turns per conversation.
    #[arg(long, env = "PDSERVE_BENCH_TURNS", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub turns: u64,
    /// Conversations in flight at once (default: all of them).
    #[arg(long, env = "PDSERVE_BENCH_CONCURRENCY", value_parser = clap::value_parser!(u64).range(1..))]
    pub concurrency: Option<u64>,
    /// Tokens of the first user message of each conversation.
    #[arg(long, env = "PDSERVE_BENCH_INPUT_LEN", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub input_len: u64,
    /// Tokens of a system prompt shared by every conversation (0: none). A shared prefix
    /// is what cache-aware routing and prefix caches exploit across conversations.
    #[arg(long, env = "PDSERVE_BENCH_SYSTEM_PROMPT_LEN", default_value_t = 0)]
    pub system_prompt_len: u64,
    /// Tokens of each later user message.
    #[arg(long, env = "PDSERVE_BENCH_TURN_INPUT_LEN", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub turn_input_len: u64,
    /// Tokens of each answer.
    #[arg(long, env = "PDSERVE_BENCH_OUTPUT_LEN", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub output_len: u64,
    /// The API conversations speak, and whether chat sends `conversation_id`.
    #[command(flatten)]
    pub protocol: ConversationApi,
    /// Seed for the prompts.
    #[arg(long, env = "PDSERVE_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
    /// SLOs for goodput.
    #[command(flatten)]
    pub slo: SloArgs,
    /// Result file, plot and label.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The API a multi-turn conversation speaks.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions`, resending the whole conversation every turn.
    #[default]
    Chat,
    /// `POST /v1/responses`, sending only the new message with the previous turn's
    /// response id as `previous_response_id` (the server holds the conversation).
    Responses,
}

impl Api {
    /// The name used on the command line and in result files.
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Responses => "responses",
        }
    }
}

/// `--api` and `--send-conversation-id`. A hand-written clap wrapper because clap's
/// conflicts cannot depend on a value: `--api chat --send-conversation-id` is fine,
/// only `--api responses` conflicts with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConversationApi {
    /// `--api`.
    pub api: Api,
    /// `--send-conversation-id` (chat only).
    pub send_conversation_id: bool,
}

/// The flags behind [`ConversationApi`], before the conflict check.
#[derive(Debug, Clone, Args)]
struct ConversationApiFlags {
    /// API to converse over: `chat` resends the conversation so far every turn;
    /// `responses` uses OpenAI's Responses API (`POST /v1/responses`, streamed, stored),
    /// sending only the new user message and `previous_response_id`, so the server holds
    /// the conversation (conflicts with `--send-conversation-id`).
    #[arg(long, env = "PDSERVE_BENCH_API", value_enum, default_value_t = Api::Chat)]
    api: Api,
    /// Send a top-level `conversation_id` field (non-standard; the pdserve gateway and
    /// vLLM's multi-turn proxy use it to reuse the previous turn's KV cache).
    #[arg(long, env = "PDSERVE_BENCH_SEND_CONVERSATION_ID")]
    send_conversation_id: bool,
}

impl ConversationApi {
    fn flags(self) -> ConversationApiFlags {
        ConversationApiFlags {
            api: self.api,
            send_conversation_id: self.send_conversation_id,
        }
    }

    fn checked(flags: ConversationApiFlags) -> Result<Self, clap::Error> {
        if flags.api == Api::Responses && flags.send_conversation_id {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::ArgumentConflict,
                "the argument '--api responses' cannot be used with '--send-conversation-id' \
                 (the Responses API chains turns with previous_response_id)",
            ));
        }
        Ok(Self {
            api: flags.api,
            send_conversation_id: flags.send_conversation_id,
        })
    }
}

checked_args!(ConversationApi, ConversationApiFlags);

/// The flag behind [`PriorityMix`], before the checks across its values.
#[derive(Debug, Clone, Args)]
struct PriorityFlags {
    /// Send vLLM's `"priority": VALUE` (an integer, lower is served first) in this
    /// SHARE (0, 1] of the requests; repeat it (comma-separated in the environment
    /// variable) for several classes, e.g. `--priority -1:0.5 --priority 0:0.5`. Shares
    /// sum to at most 1; the rest is sent without `priority` (class "none"). Each
    /// request's class is drawn from `--seed`. The report adds latency and rejections
    /// (HTTP 429, 408) per class.
    #[arg(
        long = "priority",
        env = "PDSERVE_BENCH_PRIORITY",
        value_name = "VALUE:SHARE",
        value_delimiter = ',',
        allow_hyphen_values = true,
        value_parser = PriorityClass::parse
    )]
    priority: Vec<PriorityClass>,
}

impl PriorityMix {
    fn checked(flags: PriorityFlags) -> Result<Self, clap::Error> {
        Self::new(flags.priority).map_err(|e| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for '--priority <VALUE:SHARE>': {e}"),
            )
        })
    }

    fn flags(&self) -> PriorityFlags {
        PriorityFlags {
            priority: self.classes().to_vec(),
        }
    }
}

// Duplicates and the shares' sum are checks across values, which clap's per-value
// parser cannot make.
checked_args!(PriorityMix, PriorityFlags);

/// `pdserve bench compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Result files from `--result-json`; ratios are against the first.
    #[arg(required = true, num_args = 1..)]
    pub files: Vec<PathBuf>,
    /// Write an SVG plot of every run's latency CDFs and throughput to this file.
    #[arg(long, env = "PDSERVE_BENCH_PLOT")]
    pub plot: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        priority: PriorityMix,
    }

    fn parse(args: &[&str]) -> Result<PriorityMix, String> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .map(|c| c.priority)
            .map_err(|e| e.to_string())
    }

    fn values(mix: &PriorityMix) -> Vec<(i64, f64)> {
        mix.classes().iter().map(|c| (c.value, c.share)).collect()
    }

    #[test]
    fn priority_flag_takes_repeated_and_comma_separated_classes() {
        assert!(parse(&[]).unwrap().is_empty());
        // A negative value is a value, not a flag.
        let mix = parse(&["--priority", "-1:0.5", "--priority", "0:0.5"]).unwrap();
        assert_eq!(values(&mix), vec![(-1, 0.5), (0, 0.5)]);
        let mix = parse(&["--priority=-3:0.25,7:0.25"]).unwrap();
        assert_eq!(values(&mix), vec![(-3, 0.25), (7, 0.25)]);
        assert_eq!(mix.remainder(), 0.5);
    }

    #[test]
    fn priority_flag_errors_name_the_flag_and_the_problem() {
        for (args, expected) in [
            (&["--priority", "1"][..], "VALUE:SHARE"),
            (&["--priority", "high:0.5"][..], "must be an integer"),
            (&["--priority", "1:0"][..], "(0, 1]"),
            (&["--priority", "1:2"][..], "(0, 1]"),
            (
                &["--priority", "-1:0.7", "--priority", "0:0.5"][..],
                "the shares sum to 1.2",
            ),
            (
                &["--priority", "2:0.1", "--priority", "2:0.2"][..],
                "priority 2 is given twice",
            ),
        ] {
            let err = parse(args).unwrap_err();
            assert!(
                err.contains("--priority") && err.contains(expected),
                "{args:?}: {err}"
            );
        }
    }
}
