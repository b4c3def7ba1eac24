//! `pdserve gateway` flags and the runtime configuration they resolve to.

use std::num::NonZeroUsize;
use std::time::Duration;

use pdserve_protocol::WorkerRole;
use reqwest::Url;

use crate::policy::{CacheSource, PolicyConfig, POLICY_NAMES};
use crate::registry::probe::ProbeSettings;
use crate::registry::{BreakerSettings, HealthPolicy, WorkerSpec};
use crate::GatewayError;

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
    /// prefix): a decode worker prefills them itself. Off when unset.
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

    /// Most conversations whose KV handle is kept; the least recently used is dropped first.
    #[arg(long, env = "PDSERVE_MAX_CONVERSATIONS", default_value = "100000")]
    pub max_conversations: NonZeroUsize,

    /// Most stored Responses (`/v1/responses`) the gateway remembers: which worker holds
    /// each, and its conversation, which a later turn's prefill worker is sent in full.
    /// The least recently used is forgotten first; a forgotten one is found again by
    /// asking the workers, and its next turn is served by its worker alone.
    #[arg(long, env = "PDSERVE_MAX_STORED_RESPONSES", default_value = "16384")]
    pub max_stored_responses: NonZeroUsize,

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
    pub discovery: crate::discovery::DiscoveryArgs,

    /// Where workers publish their KV-cache events.
    #[command(flatten)]
    pub kv_events: crate::kv_events::KvEventsArgs,

    /// OpenTelemetry traces (`--otlp-traces-endpoint`).
    #[command(flatten)]
    pub tracing: pdserve_telemetry::TracingArgs,

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

    /// SGLang router flag: aggregated worker URLs, space-separated (like --worker).
    #[arg(long = "worker-urls", num_args = 1.., value_name = "URL")]
    pub worker_urls: Vec<String>,

    /// `--protocol sglang`: hold the decode worker's first byte until the prefill worker's
    /// response head arrived (what SGLang's router did before its TTFT fast path). Off by
    /// default; exists to measure what the fast path saves.
    #[arg(long, env = "PDSERVE_SGLANG_WAIT_PREFILL_HEAD")]
    pub sglang_wait_prefill_head: bool,

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

/// How the gateway hands a request from prefill to decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// vLLM's sequential handoff with `kv_transfer_params`.
    #[default]
    Vllm,
    /// SGLang's bootstrap handoff: both legs at once, joined by `bootstrap_room`.
    Sglang,
}

/// Splits `--prefill` values into URLs, each with the bootstrap port that follows it
/// (a number or `none`), as SGLang's router reads `--prefill URL [BOOTSTRAP_PORT]`.
pub fn split_prefill_values(raw: &[String]) -> Result<Vec<(String, Option<u16>)>, GatewayError> {
    let mut out: Vec<(String, Option<u16>)> = Vec::new();
    for value in raw.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let port = if value.eq_ignore_ascii_case("none") {
            Some(None)
        } else if value.bytes().all(|b| b.is_ascii_digit()) {
            match value.parse::<u16>() {
                Ok(p) if p > 0 => Some(Some(p)),
                _ => {
                    return Err(GatewayError::Config(format!(
                        "--prefill bootstrap port `{value}` is not a port number (1-65535)"
                    )))
                }
            }
        } else {
            None
        };
        match (port, out.last_mut()) {
            (None, _) => out.push((value.to_string(), None)),
            (Some(port), Some(last)) => last.1 = port,
            (Some(_), None) => {
                return Err(GatewayError::Config(format!(
                    "--prefill `{value}`: a bootstrap port must follow a URL"
                )))
            }
        }
    }
    Ok(out)
}

/// Parses a non-negative number of seconds (fractions allowed) into a `Duration`.
pub(crate) fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// Everything a running gateway needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Prefill worker base URLs.
    pub prefill: Vec<Url>,
    /// Decode worker base URLs.
    pub decode: Vec<Url>,
    /// Aggregated worker base URLs.
    pub worker: Vec<Url>,
    /// Encode worker base URLs.
    pub encode: Vec<Url>,
    /// Most images per encoder sub-request (0: unlimited).
    pub encoder_max_batch_size: usize,
    /// Forward original media instead of metadata references.
    pub no_rewrite: bool,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Retries of a leg on another worker before the first byte.
    pub max_retries: u32,
    /// Prompts with fewer uncached tokens skip the prefill leg.
    pub disagg_threshold: Option<usize>,
    /// ...while every live prefill worker has at least this many prefill legs in flight.
    pub disagg_min_prefill_load: u32,
    /// Whether responses name the chosen workers.
    pub expose_routing: bool,
    /// Limit for the whole prefill leg.
    pub prefill_timeout: Duration,
    /// Limit for the decode leg's first byte.
    pub decode_timeout: Duration,
    /// Longest gap between stream chunks.
    pub stream_idle_timeout: Duration,
    /// Lifetime of a cached conversation KV handle.
    pub conversation_ttl: Duration,
    /// Capacity of the conversation cache.
    pub max_conversations: NonZeroUsize,
    /// Capacity of the Responses chain store.
    pub max_stored_responses: NonZeroUsize,
    /// Requests served at once (0: no limit).
    pub max_concurrent_requests: usize,
    /// Requests waiting for a place at most.
    pub queue_size: usize,
    /// Longest wait for a place.
    pub queue_timeout: Duration,
    /// Lifetime of an idle pooled upstream connection.
    pub upstream_idle_timeout: Duration,
    /// Limit for opening an upstream connection.
    pub connect_timeout: Duration,
    /// The routing policy's name for every role without its own.
    pub policy: String,
    /// The prefill workers' policy, when it differs from `policy`.
    pub prefill_policy: Option<String>,
    /// The decode workers' policy, when it differs from `policy`.
    pub decode_policy: Option<String>,
    /// The policies' tuning.
    pub policy_config: PolicyConfig,
    /// The admin key; `Some` enables `POST`/`DELETE /instances`.
    pub admin_api_key: Option<String>,
    /// Health probe timing.
    pub probe: ProbeSettings,
    /// Time between two scrapes of the workers' load (zero: off).
    pub load_scrape_interval: Duration,
    /// `--tokenizer`.
    pub tokenizer: Option<std::path::PathBuf>,
    /// `--tokenizer-cache-bytes`.
    pub tokenizer_cache_bytes: usize,
    /// Whether worker URLs may answer as another pdserve gateway.
    pub allow_gateway_workers: bool,
    /// The discovery sources (file, DNS, Kubernetes).
    pub discovery: crate::discovery::DiscoveryConfig,
    /// Workers' KV-event endpoints and index bounds.
    pub kv_events: crate::kv_events::KvEventsConfig,
    /// Most gateways a request may pass through (`--max-hops`).
    pub max_hops: u32,
    /// Eviction settings.
    pub health: HealthPolicy,
    /// Drain limit on shutdown.
    pub shutdown_timeout: Duration,
    /// Whether new pairs are pre-warmed.
    pub prewarm: bool,
    /// The P/D handoff protocol.
    pub protocol: Protocol,
    /// Bootstrap port of each `prefill` worker (same order; missing entries: none).
    pub prefill_bootstrap_ports: Vec<Option<u16>>,
    /// sglang: wait for the prefill response head before streaming decode.
    pub sglang_wait_prefill_head: bool,
    /// Read timeouts and the connection cap of the client-facing server.
    pub serve: pdserve_http_server::ServeOptions,
    /// The key clients of the OpenAI routes must present; `None`: open.
    pub api_key: Option<String>,
    /// The key sent to workers instead of the client's `Authorization`.
    pub worker_api_key: Option<String>,
    /// The workers' KV transfer secret, for release calls.
    pub kv_secret: Option<String>,
}

impl GatewayConfig {
    /// A configuration with the flag defaults and the given pools.
    pub fn new(prefill: Vec<Url>, decode: Vec<Url>, worker: Vec<Url>) -> Self {
        Self {
            prefill,
            decode,
            worker,
            encode: Vec::new(),
            encoder_max_batch_size: 0,
            no_rewrite: false,
            max_body_bytes: 32 * 1024 * 1024,
            max_retries: 2,
            disagg_threshold: None,
            disagg_min_prefill_load: 0,
            expose_routing: false,
            prefill_timeout: Duration::from_secs(300),
            decode_timeout: Duration::from_secs(300),
            stream_idle_timeout: Duration::from_secs(120),
            conversation_ttl: Duration::from_secs(450),
            max_conversations: NonZeroUsize::new(100_000).expect("non-zero"),
            max_stored_responses: NonZeroUsize::new(16_384).expect("non-zero"),
            max_concurrent_requests: 0,
            queue_size: 256,
            queue_timeout: Duration::from_secs(30),
            upstream_idle_timeout: Duration::from_millis(2500),
            connect_timeout: Duration::from_secs(5),
            policy: "round_robin".into(),
            prefill_policy: None,
            decode_policy: None,
            policy_config: PolicyConfig::default(),
            admin_api_key: None,
            probe: ProbeSettings {
                interval: Duration::from_secs(5),
                timeout: Duration::from_secs(2),
            },
            allow_gateway_workers: false,
            load_scrape_interval: Duration::from_secs(1),
            tokenizer: None,
            tokenizer_cache_bytes: 32 << 20,
            discovery: crate::discovery::DiscoveryConfig::default(),
            kv_events: crate::kv_events::KvEventsConfig::default(),
            max_hops: 4,
            health: HealthPolicy::default(),
            shutdown_timeout: Duration::from_secs(30),
            prewarm: false,
            protocol: Protocol::Vllm,
            prefill_bootstrap_ports: Vec::new(),
            sglang_wait_prefill_head: false,
            serve: pdserve_http_server::ServeOptions::default(),
            api_key: None,
            worker_api_key: None,
            kv_secret: None,
        }
    }

    /// The static workers as registrations.
    pub fn static_workers(&self) -> impl Iterator<Item = WorkerSpec> + '_ {
        let of = |role, urls: &'_ [Url]| {
            urls.iter()
                .map(move |u| WorkerSpec::new(role, u.clone()))
                .collect::<Vec<_>>()
        };
        let mut prefill = of(WorkerRole::Prefill, &self.prefill);
        for (spec, port) in prefill.iter_mut().zip(&self.prefill_bootstrap_ports) {
            spec.bootstrap_port = *port;
        }
        prefill
            .into_iter()
            .chain(of(WorkerRole::Decode, &self.decode))
            .chain(of(WorkerRole::PrefillDecode, &self.worker))
            .chain(of(WorkerRole::Encode, &self.encode))
    }
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

    /// Validates the flags into a runtime configuration.
    pub fn to_config(&self) -> Result<GatewayConfig, GatewayError> {
        let urls = |flag: &str, raw: &[String]| -> Result<Vec<Url>, GatewayError> {
            raw.iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_worker_url(flag, s))
                .collect()
        };
        let discovery = self.discovery.to_config()?;
        // With registration or discovery on, workers may join after start.
        let joins_later = self.dynamic_registration || discovery.any();
        let prefill_values = split_prefill_values(&self.prefill)?;
        let prefill = prefill_values
            .iter()
            .map(|(url, _)| parse_worker_url("--prefill", url))
            .collect::<Result<Vec<_>, _>>()?;
        let decode = urls("--decode", &self.decode)?;
        let mut worker = urls("--worker", &self.worker)?;
        worker.extend(urls("--worker-urls", &self.worker_urls)?);
        if self.pd_disaggregation && (prefill.is_empty() || decode.is_empty()) && !joins_later {
            return Err(GatewayError::Config(
                "--pd-disaggregation needs at least one --prefill and one --decode worker".into(),
            ));
        }
        let protocol = self.protocol.unwrap_or(if self.pd_disaggregation {
            Protocol::Sglang
        } else {
            Protocol::Vllm
        });
        let encode = urls("--encode", &self.encode)?;
        let split = !prefill.is_empty() || !decode.is_empty();
        if !worker.is_empty() && split {
            return Err(GatewayError::Config(
                "--worker (prefill_decode) workers cannot be mixed with --prefill/--decode workers"
                    .into(),
            ));
        }
        // With registration or discovery on, the missing half of a pair may join later.
        if prefill.is_empty() != decode.is_empty() && !joins_later {
            return Err(GatewayError::Config(
                "prefill/decode disaggregation needs at least one --prefill and one --decode worker \
                 (or give --worker for aggregated serving)"
                    .into(),
            ));
        }
        if !encode.is_empty() && prefill.is_empty() && worker.is_empty() && !joins_later {
            return Err(GatewayError::Config(
                "--encode workers need --prefill/--decode or --worker workers to serve the \
                 encoded requests"
                    .into(),
            ));
        }
        let admin_api_key = self.admin_api_key.clone().filter(|k| !k.is_empty());
        if self.dynamic_registration && admin_api_key.is_none() {
            return Err(GatewayError::Config(
                "--dynamic-registration needs an admin key: set ADMIN_API_KEY (or --admin-api-key)"
                    .into(),
            ));
        }
        let policy_config = PolicyConfig {
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            max_tree_size: self.max_tree_size,
            session_fallback: self.session_fallback.clone(),
            queue_cost: self.cache_queue_cost,
            precise_load_cost: self.precise_load_cost,
            cache_source: self.cache_source,
        };
        policy_config.validate().map_err(GatewayError::Config)?;
        for (flag, key) in [
            ("--api-key", &self.api_key),
            ("--worker-api-key", &self.worker_api_key),
            ("--kv-secret", &self.kv_secret),
        ] {
            if let Some(key) = key {
                if http::HeaderValue::from_str(&format!("Bearer {key}")).is_err() {
                    return Err(GatewayError::Config(format!(
                        "{flag} must be printable ASCII (it travels in an HTTP header)"
                    )));
                }
            }
        }
        if self.header_read_timeout_secs.is_zero() || self.body_read_timeout_secs.is_zero() {
            return Err(GatewayError::Config(
                "--header-read-timeout-secs and --body-read-timeout-secs must be positive".into(),
            ));
        }
        if self.probe_timeout.is_zero() {
            return Err(GatewayError::Config(
                "--probe-timeout must be positive".into(),
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(GatewayError::Config(
                "--max-body-bytes must be positive".into(),
            ));
        }
        Ok(GatewayConfig {
            prefill,
            decode,
            worker,
            encode,
            encoder_max_batch_size: self.encoder_max_batch_size,
            no_rewrite: self.no_rewrite,
            max_body_bytes: self.max_body_bytes,
            max_retries: self.max_retries,
            disagg_threshold: self.disagg_threshold,
            disagg_min_prefill_load: self.disagg_min_prefill_load,
            expose_routing: self.expose_routing,
            prefill_timeout: self.prefill_timeout_secs,
            decode_timeout: self.decode_timeout_secs,
            stream_idle_timeout: self.stream_idle_timeout_secs,
            conversation_ttl: self.conversation_ttl_secs,
            max_conversations: self.max_conversations,
            max_stored_responses: self.max_stored_responses,
            max_concurrent_requests: self.max_concurrent_requests,
            queue_size: self.queue_size,
            queue_timeout: self.queue_timeout_secs,
            upstream_idle_timeout: self.upstream_idle_timeout_secs,
            connect_timeout: self.connect_timeout_secs,
            policy: self.policy.clone(),
            prefill_policy: self.prefill_policy.clone(),
            decode_policy: self.decode_policy.clone(),
            policy_config,
            // Without dynamic registration the key has no use; admin routes stay closed.
            admin_api_key: admin_api_key.filter(|_| self.dynamic_registration),
            probe: ProbeSettings {
                interval: self.probe_interval,
                timeout: self.probe_timeout,
            },
            allow_gateway_workers: self.allow_gateway_workers,
            load_scrape_interval: self.load_scrape_interval,
            tokenizer: self.tokenizer.clone(),
            tokenizer_cache_bytes: self.tokenizer_cache_bytes,
            discovery,
            kv_events: self.kv_events.to_config()?,
            max_hops: self.max_hops,
            health: HealthPolicy {
                max_workers: self.max_workers as usize,
                fail_threshold: self.fail_threshold,
                evicted_ttl: (!self.evicted_ttl.is_zero()).then_some(self.evicted_ttl),
                breaker: BreakerSettings {
                    failure_threshold: self.cb_failure_threshold,
                    cooldown: self.cb_cooldown_secs,
                },
            },
            shutdown_timeout: self.shutdown_timeout,
            prewarm: self.prewarm,
            protocol,
            prefill_bootstrap_ports: prefill_values.iter().map(|(_, port)| *port).collect(),
            sglang_wait_prefill_head: self.sglang_wait_prefill_head,
            serve: pdserve_http_server::ServeOptions {
                header_read_timeout: self.header_read_timeout_secs,
                body_read_timeout: self.body_read_timeout_secs,
                max_connections: self.max_connections,
            },
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            worker_api_key: self.worker_api_key.clone().filter(|k| !k.is_empty()),
            kv_secret: self.kv_secret.clone().filter(|k| !k.is_empty()),
        })
    }
}

/// Parses a worker base URL (`http://host:port`, optional path prefix, no trailing `/v1`).
pub fn parse_worker_url(flag: &str, raw: &str) -> Result<Url, GatewayError> {
    let trimmed = raw.trim().trim_end_matches('/');
    let url = Url::parse(trimmed)
        .map_err(|e| GatewayError::Config(format!("{flag} `{raw}` is not a URL: {e}")))?;
    if url.scheme() != "http" {
        return Err(GatewayError::Config(format!(
            "{flag} `{raw}`: only http:// workers are supported"
        )));
    }
    if url.host_str().is_none() {
        return Err(GatewayError::Config(format!("{flag} `{raw}` has no host")));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GatewayArgs,
    }

    #[test]
    fn defaults_and_repeated_pools() {
        let cli = Cli::parse_from([
            "x",
            "--prefill",
            "http://127.0.0.1:1/",
            "--prefill",
            "http://127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
            "--conversation-ttl-secs",
            "0.5",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cli.args.port, 8000);
        assert_eq!(cli.args.host, "127.0.0.1");
        assert_eq!(cli.args.listen_addr(), "127.0.0.1:8000");
        let v6 = Cli::parse_from(["x", "--host", "::1", "--port", "9"]);
        assert_eq!(v6.args.listen_addr(), "[::1]:9");
        assert_eq!(cfg.prefill.len(), 2);
        assert_eq!(cfg.max_retries, 2);
        assert_eq!(cfg.health.breaker.failure_threshold, 5);
        assert_eq!(cfg.conversation_ttl, Duration::from_millis(500));
        assert!(cfg.upstream_idle_timeout < Duration::from_secs(5));
        assert_eq!(cfg.prefill[0].as_str(), "http://127.0.0.1:1/");
    }

    #[test]
    fn rejects_half_a_disaggregated_pair_and_bad_urls() {
        let cli = Cli::parse_from(["x", "--prefill", "http://127.0.0.1:1"]);
        assert!(cli.args.to_config().is_err());
        let cli = Cli::parse_from(["x", "--worker", "ftp://h"]);
        assert!(cli.args.to_config().is_err());
        let cli = Cli::parse_from(["x", "--worker", "http://127.0.0.1:9"]);
        assert!(cli.args.to_config().is_ok());
        let cli = Cli::parse_from([
            "x",
            "--worker",
            "http://127.0.0.1:9",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
        ]);
        assert!(
            cli.args.to_config().is_err(),
            "prefill_decode mixed with P/D"
        );
    }

    #[test]
    fn encoders_join_either_topology() {
        let cli = Cli::parse_from([
            "x",
            "--encode",
            "http://127.0.0.1:7",
            "--encode",
            "http://127.0.0.1:8",
            "--worker",
            "http://127.0.0.1:9",
            "--encoder-max-batch-size",
            "4",
            "--no-rewrite",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cfg.encode.len(), 2);
        assert_eq!((cfg.encoder_max_batch_size, cfg.no_rewrite), (4, true));
        let roles: Vec<_> = cfg.static_workers().map(|s| s.role).collect();
        assert_eq!(
            roles,
            [
                WorkerRole::PrefillDecode,
                WorkerRole::Encode,
                WorkerRole::Encode
            ]
        );
        let defaults = Cli::parse_from(["x", "--worker", "http://127.0.0.1:9"]);
        let cfg = defaults.args.to_config().unwrap();
        assert_eq!((cfg.encoder_max_batch_size, cfg.no_rewrite), (0, false));
        assert_eq!(
            defaults.args.max_retries, 2,
            "--decode-retries is its alias"
        );
        let alone = Cli::parse_from(["x", "--encode", "http://127.0.0.1:7"]);
        assert!(alone.args.to_config().is_err(), "encoders need a consumer");
        let alias = Cli::parse_from(["x", "--decode-retries", "1"]);
        assert_eq!(alias.args.max_retries, 1);
    }

    #[test]
    fn sglang_router_flags() {
        let cli = Cli::parse_from([
            "x",
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:1",
            "8998",
            "--prefill",
            "http://127.0.0.1:2",
            "--prefill",
            "http://127.0.0.1:3",
            "none",
            "--decode",
            "http://127.0.0.1:4",
            "--policy",
            "cache_aware",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cfg.protocol, Protocol::Sglang);
        assert_eq!(cfg.prefill.len(), 3);
        assert_eq!(cfg.prefill_bootstrap_ports, [Some(8998), None, None]);
        let ports: Vec<_> = cfg
            .static_workers()
            .filter(|s| s.role == WorkerRole::Prefill)
            .map(|s| s.bootstrap_port)
            .collect();
        assert_eq!(ports, [Some(8998), None, None]);
        // vLLM mode stays the default, and comma-separated pools still split.
        let cli = Cli::parse_from([
            "x",
            "--prefill",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:4",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!((cfg.protocol, cfg.prefill.len()), (Protocol::Vllm, 2));
        let cli = Cli::parse_from([
            "x",
            "--pd-disaggregation",
            "--protocol",
            "vllm",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:4",
        ]);
        assert_eq!(cli.args.to_config().unwrap().protocol, Protocol::Vllm);
        let cli = Cli::parse_from([
            "x",
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
        ]);
        assert_eq!(cli.args.to_config().unwrap().worker.len(), 2);
        for bad in [
            vec!["x", "--pd-disaggregation", "--decode", "http://127.0.0.1:4"],
            vec!["x", "--prefill", "8998", "--decode", "http://127.0.0.1:4"],
            vec![
                "x",
                "--prefill",
                "http://127.0.0.1:1",
                "70000",
                "--decode",
                "http://127.0.0.1:4",
            ],
        ] {
            let cli = Cli::parse_from(bad.clone());
            assert!(cli.args.to_config().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn dynamic_registration_needs_an_admin_key() {
        let cli = Cli::parse_from(["x", "--dynamic-registration", "--admin-api-key", ""]);
        assert!(cli.args.to_config().is_err());
        let cli = Cli::parse_from([
            "x",
            "--dynamic-registration",
            "--admin-api-key",
            "k",
            "--prefill",
            "http://127.0.0.1:1",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cfg.admin_api_key.as_deref(), Some("k"));
        assert_eq!(cfg.health.fail_threshold, 3);
        assert_eq!(cfg.health.evicted_ttl, Some(Duration::from_secs(900)));
        assert_eq!(cfg.probe.interval, Duration::from_secs(5));
        let cli = Cli::parse_from(["x", "--admin-api-key", "k", "--evicted-ttl", "0"]);
        let cfg = cli.args.to_config().unwrap();
        assert!(
            cfg.admin_api_key.is_none(),
            "admin routes stay closed without the flag"
        );
        assert!(cfg.health.evicted_ttl.is_none());
        assert!(Cli::try_parse_from(["x", "--fail-threshold", "0"]).is_err());
        assert!(Cli::try_parse_from(["x", "--policy", "nope"]).is_err());
        let cli = Cli::parse_from([
            "x",
            "--decode-policy",
            "cache_aware",
            "--cache-threshold",
            "0.3",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cfg.decode_policy.as_deref(), Some("cache_aware"));
        assert_eq!(cfg.policy_config.cache_threshold, 0.3);
        for bad in [
            ["--cache-threshold", "1.5"],
            ["--session-fallback", "session"],
            ["--max-tree-size", "0"],
        ] {
            let cli = Cli::parse_from(["x", bad[0], bad[1]]);
            assert!(cli.args.to_config().is_err(), "{bad:?}");
        }
    }
}
