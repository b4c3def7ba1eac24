//! `pdserve gateway`'s flags and the configuration they resolve to: [`GatewayArgs`] as
//! clap reads them, checked by [`GatewayArgs::to_config`] into the [`GatewayConfig`]
//! that the server's components are built from.

mod args;
mod resolve;
#[cfg(test)]
mod tests;

use std::num::NonZeroUsize;
use std::time::Duration;

use pdserve_protocol::WorkerRole;
use reqwest::Url;

use crate::fleet::registry::probe::ProbeSettings;
use crate::fleet::registry::{HealthPolicy, WorkerSpec};
use crate::policy::PolicyConfig;

pub use args::GatewayArgs;
pub use resolve::split_prefill_values;

// The request path's vocabulary, which the flags name.
pub use crate::serving::settings::{FirstTokenFromPrefill, Protocol};

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
    pub discovery: crate::fleet::discovery::DiscoveryConfig,
    /// Workers' KV-event endpoints and index bounds.
    pub kv_events: crate::fleet::kv_events::KvEventsConfig,
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
    /// Whether a streamed answer's first token comes from the prefill leg.
    pub first_token_from_prefill: FirstTokenFromPrefill,
    /// Read timeouts and the connection cap of the client-facing server.
    pub serve: pdserve_http_server::ServeOptions,
    /// The key clients of the OpenAI routes must present; `None`: open.
    pub api_key: Option<String>,
    /// The key sent to workers instead of the client's `Authorization`.
    pub worker_api_key: Option<String>,
    /// The workers' KV transfer secret, for release calls.
    pub kv_secret: Option<String>,
    /// Where stored responses and conversations live.
    pub history: pdserve_history::HistoryOptions,
    /// Latency objectives for requests that name none.
    pub slo: crate::ingress::slo::Slo,
    /// Requests above this priority may be shed on a prediction.
    pub shed_priority: i64,
    /// How often the P:D planner decides.
    pub planner_interval: std::time::Duration,
    /// The finished requests the planner looks back over.
    pub planner_window: std::time::Duration,
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
            discovery: crate::fleet::discovery::DiscoveryConfig::default(),
            kv_events: crate::fleet::kv_events::KvEventsConfig::default(),
            max_hops: 4,
            health: HealthPolicy::default(),
            shutdown_timeout: Duration::from_secs(30),
            prewarm: false,
            protocol: Protocol::Vllm,
            prefill_bootstrap_ports: Vec::new(),
            sglang_wait_prefill_head: false,
            first_token_from_prefill: FirstTokenFromPrefill::Auto,
            serve: pdserve_http_server::ServeOptions::default(),
            api_key: None,
            worker_api_key: None,
            kv_secret: None,
            history: pdserve_history::HistoryOptions {
                backend: pdserve_history::HistoryBackend::Memory,
                url: None,
                retention: Duration::from_secs(30 * 24 * 3600),
                max_responses: 100_000,
                max_conversations: 100_000,
                timeout: Duration::from_secs(2),
            },
            slo: Default::default(),
            shed_priority: 0,
            planner_interval: std::time::Duration::from_secs(5),
            planner_window: std::time::Duration::from_secs(60),
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
