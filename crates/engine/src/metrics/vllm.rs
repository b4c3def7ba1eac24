//! The worker's metrics also under vLLM's names, meanings and histogram buckets (as in
//! vLLM's `vllm/v1/metrics/loggers.py`), labelled `model_name` and `engine`, so that
//! load-aware routers and dashboards built for vLLM read pdserve workers unchanged.
//!
//! Counters and request gauges share their values with the `pdserve_*` series (a
//! prometheus-client metric's clone is the same metric); the histograms have vLLM's
//! buckets, so they are observed separately.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request latency buckets (`vllm:e2e_request_latency_seconds`).
pub const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The histograms and the gauge only vLLM's names have.
#[derive(Debug)]
pub struct VllmMetrics {
    /// `vllm:kv_cache_usage_perc`: fraction (0..1) of KV blocks in use.
    pub kv_cache_usage: Gauge<f64, AtomicU64>,
    /// `vllm:time_to_first_token_seconds`.
    pub time_to_first_token: Histogram,
    /// `vllm:inter_token_latency_seconds`: time between two tokens of one request.
    pub inter_token_latency: Histogram,
    /// `vllm:e2e_request_latency_seconds`.
    pub e2e_request_latency: Histogram,
}

impl Default for VllmMetrics {
    fn default() -> Self {
        Self {
            kv_cache_usage: Gauge::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// The shared series registered under vLLM's names.
pub(crate) struct Shared {
    pub running: Gauge,
    pub waiting: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
}

impl VllmMetrics {
    /// A registry (no prefix: the names carry `vllm:`) labelled with `model_name`.
    pub(crate) fn registry(&self, model_name: &str, shared: Shared) -> Registry {
        let labels = [
            ("model_name".into(), model_name.to_string().into()),
            ("engine".into(), "0".into()),
        ];
        let mut r = Registry::with_labels(labels.into_iter());
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            shared.running,
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            shared.waiting,
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self.kv_cache_usage.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            shared.prompt_tokens,
        );
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            shared.generation_tokens,
        );
        r.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            shared.prefix_cache_queries,
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            shared.prefix_cache_hits,
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self.time_to_first_token.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            self.inter_token_latency.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            self.e2e_request_latency.clone(),
        );
        r
    }

    /// Sets `vllm:kv_cache_usage_perc` from the block counts (free includes reclaimable
    /// cached blocks, as vLLM's free-block count does).
    pub fn set_kv_usage(&self, used: usize, free: usize) {
        let total = used + free;
        let usage = if total == 0 {
            0.0
        } else {
            used as f64 / total as f64
        };
        self.kv_cache_usage.set(usage);
    }
}
