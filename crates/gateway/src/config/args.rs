//! `pdserve gateway`'s flags, as clap reads them (with their environment fallbacks).

use std::num::NonZeroUsize;
use std::time::Duration;

use super::{FirstTokenFromPrefill, Protocol};
use crate::flags::parse_secs;
use crate::policy::{CacheSource, PolicyConfig, POLICY_NAMES};

/// `pdserve gateway` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on.
    #[arg(long, env = "PDSERVE_GATEWAY_HOST", default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on.
    #[arg(long, env = "PDSERVE_GATEWAY_PORT", default_value_t = 8000)]
    pub port: u16,

    /// Prefill worker base URL (e.g. http://127.0.0.1:8100); repeat for a pool.
    /// Comma-separated in the environment variable. As in SGLang's router, the URL may be
    /// followed by the worker's bootstrap port or `none` (`--prefill URL 8998`).
    #[arg(
        long = "prefill",
        env = "PDSERVE_PREFILL",
        value_delimiter = ',',
        num_args = 1..=2,
        value_names = ["URL", "BOOTSTRAP_PORT"]
    )]
    pub prefill: Vec<String>,

    /// Decode worker base URL; repeat for a pool. Comma-separated in the environment variable.
    #[arg(long = "decode", env = "PDSERVE_DECODE", value_delimiter = ',')]
    pub decode: Vec<String>,

    /// Aggregated (prefill+decode) worker base URL, used when no prefill/decode pair is
    /// configured; repeat for a pool. Comma-separated in the environment variable.
    #[arg(long = "worker", env = "PDSERVE_WORKER", value_delimiter = ',')]
    pub worker: Vec<String>,

    /// Encode worker base URL (vLLM's disaggregated media encoder); repeat for a pool.
    /// Requests with image, audio or video items are encoded there first (E+P+D with
    /// --prefill/--decode, E+PD with --worker). Comma-separated in the environment variable.
    #[arg(long = "encode", env = "PDSERVE_ENCODE", value_delimiter = ',')]
    pub encode: Vec<String>,

    /// Most images of one request sent to one encoder in a single sub-request; 0 puts
    /// all of a request's images for an encoder in one. Audio and video items always go
    /// one per sub-request.
    #[arg(long, env = "PDSERVE_ENCODER_MAX_BATCH_SIZE", default_value_t = 0)]
    pub encoder_max_batch_size: usize,

    /// Forward the original media to the prefill/decode workers instead of rewriting the
    /// items into references to the encoders' embeddings (to A/B the rewrite). The
    /// encoders still run, without gateway-assigned uuids, so both sides hash the media.
    #[arg(long, env = "PDSERVE_NO_REWRITE")]
    pub no_rewrite: bool,

    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, env = "PDSERVE_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// How many times a leg (prefill or decode) that fails before its first byte reaches
    /// the client (connection error, timeout, 5xx; never a 4xx) is retried on another
    /// worker, with exponential backoff and jitter. 0 disables retries.
    #[arg(
        long,
        alias = "decode-retries",
        env = "PDSERVE_MAX_RETRIES",
        default_value_t = 2
    )]
    pub max_retries: u32,

    /// Consecutive failed requests that open a worker's circuit breaker (no traffic for
    /// --cb-cooldown-secs, then one trial request decides). 0 turns breaking off.
    #[arg(long, env = "PDSERVE_CB_FAILURE_THRESHOLD", default_value_t = 5)]
    pub cb_failure_threshold: u32,

    /// Seconds an open circuit holds traffic back before its trial request.
    #[arg(long, env = "PDSERVE_CB_COOLDOWN_SECS", default_value = "30", value_parser = parse_secs)]
    pub cb_cooldown_secs: Duration,

    /// Skip the prefill leg for requests whose uncached prompt part is shorter than this
    /// many tokens (estimated from the prompt; exact when the cache_aware policy knows the
    /// prefix): a decode worker prefills them itself, one at a time per decode worker
    /// (until its answer starts; the others get their prefill leg). Off when unset.
    #[arg(long, env = "PDSERVE_DISAGG_THRESHOLD")]
    pub disagg_threshold: Option<usize>,

    /// With --disagg-threshold: skip the prefill leg only while every live prefill
    /// worker has at least this many prefill legs in flight; an idle prefill worker still
    /// takes short prompts (worth it where prefill workers have more compute than a
    /// decode worker, e.g. `pdserve up`'s shared cores). 0: whatever their load.
    #[arg(
        long,
        env = "PDSERVE_DISAGG_MIN_PREFILL_LOAD",
        default_value_t = 0,
        requires = "disagg_threshold"
    )]
    pub disagg_min_prefill_load: u32,

    /// Name the chosen workers in response headers (`x-pdserve-prefill`,
    /// `x-pdserve-decode`, `x-pdserve-worker`).
    #[arg(long, env = "PDSERVE_EXPOSE_ROUTING")]
    pub expose_routing: bool,

    /// Time limit in seconds for the whole prefill leg (and for each encoder sub-request);
    /// past it the client gets 504 (502 for an encoder).
    #[arg(long, env = "PDSERVE_PREFILL_TIMEOUT_SECS", default_value = "300", value_parser = parse_secs)]
    pub prefill_timeout_secs: Duration,

    /// Time limit in seconds for the decode (or aggregated) leg's first byte; past it the
    /// client gets 504. A non-stream answer's first byte comes when it is complete, so for
    /// non-stream requests this bounds the whole generation.
    #[arg(long, env = "PDSERVE_DECODE_TIMEOUT_SECS", default_value = "300", value_parser = parse_secs)]
    pub decode_timeout_secs: Duration,

    /// Longest silence in seconds between two chunks of a streaming response; past it the
    /// stream ends with an error event.
    #[arg(long, env = "PDSERVE_STREAM_IDLE_TIMEOUT_SECS", default_value = "120", value_parser = parse_secs)]
    pub stream_idle_timeout_secs: Duration,

    /// How long in seconds a conversation's decode KV handle is kept for its next turn.
    /// Keep it below the workers' KV abort timeout (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
    #[arg(long, env = "PDSERVE_CONVERSATION_TTL_SECS", default_value = "450", value_parser = parse_secs)]
    pub conversation_ttl_secs: Duration,

    /// The time-to-first-token objective, in milliseconds, of requests without an
    /// `x-slo-ttft-ms` header: the queue orders waiters by arrival + this (within their
    /// priority), and the latency predictor aims at it. None by default.
    #[arg(long, env = "PDSERVE_SLO_TTFT_MS", value_parser = crate::ingress::slo::parse_ms)]
    pub slo_ttft_ms: Option<Duration>,

    /// The time-per-output-token objective, in milliseconds, of requests without an
    /// `x-slo-tpot-ms` header. None by default.
    #[arg(long, env = "PDSERVE_SLO_TPOT_MS", value_parser = crate::ingress::slo::parse_ms)]
    pub slo_tpot_ms: Option<Duration>,

    /// Requests whose priority is above this (later in vLLM's order: `priority` in the
    /// body, else `x-pdserve-priority`) are sheddable: with `--policy slo`, once its
    /// predictor is trained, such a request is refused with 429 and `Retry-After` when no
    /// worker is predicted to meet its objectives. Requests at or below it are never shed
    /// on a prediction.
    #[arg(
        long,
        env = "PDSERVE_SHED_PRIORITY",
        default_value = "0",
        allow_hyphen_values = true
    )]
    pub shed_priority: i64,

    /// How often, in seconds, the P:D planner decides how many prefill and decode workers
    /// the fleet should have (`GET /planner`, `pdserve_planner_desired_workers{role}`);
    /// 0 decides only when `/planner` is read.
    #[arg(long, env = "PDSERVE_PLANNER_INTERVAL_SECS", default_value = "5", value_parser = parse_secs)]
    pub planner_interval_secs: Duration,

    /// The finished requests, in seconds back, whose SLO attainment the planner weighs.
    /// Its targets are `--slo-ttft-ms` and `--slo-tpot-ms` (else 500 ms and 50 ms).
    #[arg(long, env = "PDSERVE_PLANNER_WINDOW_SECS", default_value = "60", value_parser = parse_secs)]
    pub planner_window_secs: Duration,

    /// Most conversations whose KV handle is kept; the least recently used is dropped first.
    #[arg(long, env = "PDSERVE_MAX_CONVERSATIONS", default_value = "100000")]
    pub max_conversations: NonZeroUsize,

    /// Most generation requests (chat, completions, Responses, SGLang's `/generate`)
    /// served at once; the others wait in a queue, by
    /// priority (vLLM's `priority` field, or the `x-pdserve-priority` header; lower
    /// first) and then arrival. 0: no limit.
    #[arg(long, env = "PDSERVE_MAX_CONCURRENT_REQUESTS", default_value_t = 0)]
    pub max_concurrent_requests: usize,

    /// Most requests waiting for a place (with --max-concurrent-requests); past it a
    /// request is answered 429 with Retry-After.
    #[arg(long, env = "PDSERVE_QUEUE_SIZE", default_value_t = 256)]
    pub queue_size: usize,

    /// Longest wait for a place in seconds; past it a request is answered 408 with
    /// Retry-After.
    #[arg(long, env = "PDSERVE_QUEUE_TIMEOUT_SECS", default_value = "30", value_parser = parse_secs)]
    pub queue_timeout_secs: Duration,

    /// Seconds an idle pooled upstream connection is kept. Must stay below the workers'
    /// keep-alive (vLLM closes idle connections after 5 s) or requests race the close.
    #[arg(long, env = "PDSERVE_UPSTREAM_IDLE_TIMEOUT_SECS", default_value = "2.5", value_parser = parse_secs)]
    pub upstream_idle_timeout_secs: Duration,

    /// Time limit in seconds for opening a TCP connection to a worker.
    #[arg(long, env = "PDSERVE_CONNECT_TIMEOUT_SECS", default_value = "5", value_parser = parse_secs)]
    pub connect_timeout_secs: Duration,

    /// How a worker is chosen among the live workers of a role: round_robin, random,
    /// power_of_two (the less loaded of two random workers), cache_aware (the worker that
    /// already holds the longest prefix of the prompt, unless load is imbalanced),
    /// precise_prefix (the worker whose own KV events hold the most of the prompt, net of
    /// load; needs --kv-events and token ids or --tokenizer, else cache_aware decides) or
    /// session (the same conversation_id / X-Session-Id / `user` to the same worker).
    #[arg(long, env = "PDSERVE_POLICY", default_value = "round_robin", value_parser = clap::builder::PossibleValuesParser::new(POLICY_NAMES))]
    pub policy: String,

    /// Policy for choosing prefill workers (default: --policy).
    #[arg(long, env = "PDSERVE_PREFILL_POLICY", value_parser = clap::builder::PossibleValuesParser::new(POLICY_NAMES))]
    pub prefill_policy: Option<String>,

    /// Policy for choosing decode workers (default: --policy).
    #[arg(long, env = "PDSERVE_DECODE_POLICY", value_parser = clap::builder::PossibleValuesParser::new(POLICY_NAMES))]
    pub decode_policy: Option<String>,

    /// cache_aware: route to the worker with the longest cached prefix when it covers more
    /// than this share of the prompt (0-1).
    #[arg(long, env = "PDSERVE_CACHE_THRESHOLD", default_value_t = PolicyConfig::default().cache_threshold)]
    pub cache_threshold: f64,

    /// cache_aware: load counts as imbalanced when the busiest worker has more than this
    /// many in-flight requests over the idlest (and the relative threshold holds too);
    /// then the least-loaded worker is chosen.
    #[arg(long, env = "PDSERVE_BALANCE_ABS_THRESHOLD", default_value_t = PolicyConfig::default().balance_abs_threshold)]
    pub balance_abs_threshold: usize,

    /// cache_aware: load counts as imbalanced when the busiest worker has more than this
    /// factor times the idlest one's in-flight requests (and the absolute threshold holds).
    #[arg(long, env = "PDSERVE_BALANCE_REL_THRESHOLD", default_value_t = PolicyConfig::default().balance_rel_threshold)]
    pub balance_rel_threshold: f64,

    /// cache_aware: cap of each worker's prefix tree in approximate bytes; least recently
    /// used branches are evicted past it, so memory stays flat under prefix churn.
    #[arg(long, env = "PDSERVE_MAX_TREE_SIZE", default_value_t = PolicyConfig::default().max_tree_size)]
    pub max_tree_size: usize,

    /// cache_aware: prompts of compute one extra in-flight request costs. The longest match
    /// loses to the least-loaded worker when its extra load costs more than the cached
    /// tokens it has over that worker, so a prefix every prompt shares (a system prompt)
    /// does not pull all traffic onto one worker. About 0.5 suits small CPU workers;
    /// 0 (default) is SGLang's behaviour.
    #[arg(long, env = "PDSERVE_CACHE_QUEUE_COST", default_value_t = 0.0)]
    pub cache_queue_cost: f64,

    /// precise_prefix: the share of the prompt one request of a worker's load costs
    /// (score = cached tokens − this × load × prompt tokens): a worker whose KV events
    /// hold more of the prompt wins unless its extra load costs more than that lead. The
    /// default, 0.1, takes a queued request to cost a tenth of a prompt (most of a queue
    /// that shares prefixes is cached); 1 treats every queued prompt as computed whole.
    #[arg(long, env = "PDSERVE_PRECISE_LOAD_COST", default_value_t = PolicyConfig::default().precise_load_cost)]
    pub precise_load_cost: f64,

    /// cache_aware: where a worker's cached share of a prompt comes from when the prompt
    /// has token ids (token-id prompts, or any with --tokenizer): `auto` — the worker's
    /// KV events where it publishes them, the approximate tree elsewhere; `events` —
    /// events only; `approximate` — the gateway's own tree of what it sent.
    #[arg(long, env = "PDSERVE_CACHE_SOURCE", value_enum, default_value_t = CacheSource::Auto)]
    pub cache_source: CacheSource,

    /// session: the policy for requests that carry no session key.
    #[arg(long, env = "PDSERVE_SESSION_FALLBACK", default_value = "round_robin")]
    pub session_fallback: String,

    /// Let workers join and leave at run time through `POST /instances` and
    /// `DELETE /instances?url=...` (admin calls need ADMIN_API_KEY). Static
    /// --prefill/--decode/--worker flags may be combined with it.
    #[arg(long, env = "PDSERVE_DYNAMIC_REGISTRATION")]
    pub dynamic_registration: bool,

    /// The key admin calls must send in `X-API-Key` (or `Authorization: Bearer`).
    /// Required by --dynamic-registration.
    #[arg(long, env = "ADMIN_API_KEY", hide_env_values = true)]
    pub admin_api_key: Option<String>,

    /// Workers found at run time: a watched file, DNS names, Kubernetes pods.
    #[command(flatten)]
    pub discovery: crate::fleet::discovery::DiscoveryArgs,

    /// Where workers publish their KV-cache events.
    #[command(flatten)]
    pub kv_events: crate::fleet::kv_events::KvEventsArgs,

    /// OpenTelemetry traces (`--otlp-traces-endpoint`).
    #[command(flatten)]
    pub tracing: pdserve_telemetry::TracingArgs,

    /// Where stored responses and conversations live (`--history-backend`).
    #[command(flatten)]
    pub history: pdserve_history::HistoryArgs,

    /// Most workers the roster holds (static, registered and discovered together);
    /// registrations past it get 429.
    #[arg(long, env = "PDSERVE_MAX_WORKERS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_workers: u32,

    /// Accept worker URLs that answer as another pdserve gateway (a tier of regional
    /// gateways behind this one). Off: registration, static flags and discovery refuse
    /// them, so a selector that also matches gateway pods cannot make a loop. A gateway's
    /// own URL is refused either way.
    #[arg(long, env = "PDSERVE_ALLOW_GATEWAY_WORKERS")]
    pub allow_gateway_workers: bool,

    /// Most gateways a request may pass through, this one included; past it, or on
    /// reaching a gateway it already passed, the request is refused with 508 Loop
    /// Detected. Gateways name themselves in the `X-Pdserve-Hops` header of every leg.
    #[arg(long, env = "PDSERVE_MAX_HOPS", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_hops: u32,

    /// Seconds between health probes (`GET /health`) of every registered worker; 0 turns
    /// probing off.
    #[arg(long, env = "PDSERVE_PROBE_INTERVAL", default_value = "5", value_parser = parse_secs)]
    pub probe_interval: Duration,

    /// The served model's tokenizer and chat template: its GGUF (no weights are read), or
    /// a Hugging Face model folder holding `tokenizer.json` (and `tokenizer_config.json`,
    /// as vLLM and SGLang workers load it): the gateway then tokenizes prompts as the
    /// workers do, so prefix matching and `--disagg-threshold` and the context-length
    /// check use exact token counts.
    #[arg(long, env = "PDSERVE_TOKENIZER", value_name = "GGUF|DIR")]
    pub tokenizer: Option<std::path::PathBuf>,

    /// With --tokenizer: approximate bytes of remembered token ids of the text between
    /// special tokens (system prompts, earlier turns), so repeated text is not tokenized
    /// again; least recently used first out. The ids are the same either way. 0 turns it
    /// off; tokenizers whose special tokens are normalized or strip spaces never use it.
    #[arg(long, env = "PDSERVE_TOKENIZER_CACHE_BYTES", default_value_t = 32 << 20, value_name = "BYTES")]
    pub tokenizer_cache_bytes: usize,

    /// Seconds between reads of every worker's `/metrics` for the load it reports
    /// (vLLM's `vllm:num_requests_waiting`/`running`, SGLang's queue gauges), which
    /// `power_of_two` and `cache_aware` balance on, the same for every gateway replica;
    /// this gateway's in-flight count is the fallback and the tie-break. 0 turns it off.
    #[arg(long, env = "PDSERVE_LOAD_SCRAPE_INTERVAL", default_value = "1", value_parser = parse_secs)]
    pub load_scrape_interval: Duration,

    /// Time limit in seconds of one health probe.
    #[arg(long, env = "PDSERVE_PROBE_TIMEOUT", default_value = "2", value_parser = parse_secs)]
    pub probe_timeout: Duration,

    /// Consecutive failed probes that evict a worker (no new requests go to it until a
    /// probe succeeds). A request that cannot connect to a worker evicts it at once.
    #[arg(long, env = "PDSERVE_FAIL_THRESHOLD", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub fail_threshold: u32,

    /// Seconds an evicted worker is still probed before it is forgotten; 0 probes it forever.
    #[arg(long, env = "PDSERVE_EVICTED_TTL", default_value = "900", value_parser = parse_secs)]
    pub evicted_ttl: Duration,

    /// On SIGTERM or Ctrl-C, seconds to let open requests (streams included) finish
    /// before the gateway exits anyway.
    #[arg(long, env = "PDSERVE_SHUTDOWN_TIMEOUT", default_value = "30", value_parser = parse_secs)]
    pub shutdown_timeout: Duration,

    /// Send one tiny request (prompt " x", one token) through every prefill/decode pair
    /// (or prefill_decode worker) as it becomes routable, so the first user request does
    /// not pay connection and KV-transfer set-up. Retried every 5 s, up to 60 times.
    #[arg(long, env = "PDSERVE_PREWARM")]
    pub prewarm: bool,

    /// The P/D handoff protocol. `vllm`: prefill first, then decode with the prefill
    /// worker's `kv_transfer_params`. `sglang`: `bootstrap_host`/`bootstrap_port`/
    /// `bootstrap_room` injected into one body sent to prefill and decode at once (also
    /// serves SGLang's native `POST /generate`). Default: `sglang` with
    /// --pd-disaggregation, else `vllm`.
    #[arg(long, env = "PDSERVE_PROTOCOL", value_enum)]
    pub protocol: Option<Protocol>,

    /// SGLang router flag: prefill/decode disaggregation over --prefill and --decode
    /// workers; selects `--protocol sglang` unless --protocol says otherwise.
    #[arg(long, env = "PDSERVE_PD_DISAGGREGATION")]
    pub pd_disaggregation: bool,

    /// SGLang router flag: aggregated worker URLs, space-separated (like --worker); the
    /// environment variable takes them comma-separated.
    #[arg(
        long = "worker-urls",
        env = "PDSERVE_WORKER_URLS",
        num_args = 1..,
        value_delimiter = ',',
        value_name = "URL"
    )]
    pub worker_urls: Vec<String>,

    /// `--protocol sglang`: hold the decode worker's first byte until the prefill worker's
    /// response head arrived (what SGLang's router did before its TTFT fast path). Off by
    /// default; exists to measure what the fast path saves.
    #[arg(long, env = "PDSERVE_SGLANG_WAIT_PREFILL_HEAD")]
    pub sglang_wait_prefill_head: bool,

    /// vLLM P/D, streamed chat and completions: send the prefill answer's token (its
    /// first token) to the client as soon as the prefill leg answered (before the decode
    /// leg is sent; with --expose-routing, once the decode worker answered; a decode leg
    /// that then fails for good is an error event in the stream), then relay the decode worker's stream without the first token it generates again (dropped only
    /// if equal; a different one ends the stream with an error event and counts in
    /// pdserve_gateway_first_token_mismatch_total). A request without a `seed` gets one
    /// (the same on both legs) so a sampled first token is the one decode draws. `auto`:
    /// per answer, where the prefill answer carries the token; `on`: the same, and an
    /// answer without it is a warning; `off`: never. A request's
    /// `"first_token_from_prefill": true|false` overrides.
    #[arg(
        long,
        env = "PDSERVE_FIRST_TOKEN_FROM_PREFILL",
        value_enum,
        default_value = "auto"
    )]
    pub first_token_from_prefill: FirstTokenFromPrefill,

    // --- Hardening (issue 14): read timeouts, connection cap, API keys. ---
    /// Seconds a client has to send a complete request head; a connection that sends half
    /// a head, or no next request on keep-alive, is closed after this long.
    #[arg(long, env = "PDSERVE_HEADER_READ_TIMEOUT_SECS", default_value = "30", value_parser = parse_secs)]
    pub header_read_timeout_secs: Duration,

    /// Seconds from a request's head to the end of its body; a client still sending then
    /// gets 408 and its connection is closed.
    #[arg(long, env = "PDSERVE_BODY_READ_TIMEOUT_SECS", default_value = "30", value_parser = parse_secs)]
    pub body_read_timeout_secs: Duration,

    /// Most open client connections; further connections are not accepted (they wait in
    /// the listen backlog) until one closes. 0: no cap.
    #[arg(long, env = "PDSERVE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// Clients of the OpenAI routes (/v1/*) must send `Authorization: Bearer <key>`
    /// (else 401); /health, /readiness, /liveness and /metrics stay open.
    #[arg(long, env = "PDSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// The key the gateway sends to workers (`Authorization: Bearer <key>`) in place of
    /// the client's header. Unset: the client's `Authorization` is forwarded as is.
    #[arg(long, env = "PDSERVE_WORKER_API_KEY", hide_env_values = true)]
    pub worker_api_key: Option<String>,

    /// The workers' KV transfer secret (their PDSERVE_KV_SECRET), sent when the gateway
    /// asks a prefill worker to release a KV handle decode will not read.
    #[arg(long, env = "PDSERVE_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
}

impl GatewayArgs {
    /// The `host:port` to bind (`host` may be a name such as `localhost`).
    pub fn listen_addr(&self) -> String {
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        if host.contains(':') {
            format!("[{host}]:{}", self.port)
        } else {
            format!("{host}:{}", self.port)
        }
    }
}
