//! Orchestrator metrics (`pdserve_orchestrator_*`); all zero on a worker without
//! `--prefill`.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels naming a prefill worker and an outcome.
pub type PrefillLabels = Vec<(&'static str, String)>;

/// What the orchestrator counts.
#[derive(Debug)]
pub struct OrchestratorMetrics {
    /// Prefill legs of user requests, by prefill worker and outcome (`ok`, `rejected`,
    /// `failed`, `unreachable`, `broken`, `timeout`, `bad_answer`).
    pub prefill_requests: Family<PrefillLabels, Counter>,
    /// Wall time of a prefill leg, send to complete answer.
    pub prefill_seconds: Histogram,
    /// Prefill workers currently warm.
    pub warm_prefill_workers: Gauge,
    /// Pre-warm attempts by outcome (`ok`, `failed`).
    pub prewarms: Family<PrefillLabels, Counter>,
    /// Concurrent handoffs whose early KV read failed and that read by the prefill's
    /// answer instead.
    pub concurrent_fallbacks: Counter,
    /// Requests that asked the prefill leg for its first token, by whether the decode
    /// started from it (`used`), the answer had none (`missing`) or one that could not
    /// start it (`unusable`: a stop token, outside the vocabulary).
    pub first_tokens: Family<PrefillLabels, Counter>,
}

impl Default for OrchestratorMetrics {
    fn default() -> Self {
        Self {
            prefill_requests: Family::default(),
            prefill_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            warm_prefill_workers: Gauge::default(),
            prewarms: Family::default(),
            concurrent_fallbacks: Counter::default(),
            first_tokens: Family::default(),
        }
    }
}

impl OrchestratorMetrics {
    /// Counts one prefill leg to `prefill` that ended with `outcome` after `elapsed`.
    pub fn observe_prefill(&self, prefill: &str, outcome: &'static str, elapsed: Duration) {
        self.prefill_requests
            .get_or_create(&vec![
                ("prefill", prefill.to_string()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
        self.prefill_seconds.observe(elapsed.as_secs_f64());
    }

    /// Counts one pre-warm attempt.
    pub fn prewarm(&self, outcome: &'static str) {
        self.prewarms
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// Counts one first token asked of a prefill leg, by what became of it.
    pub fn first_token(&self, outcome: &'static str) {
        self.first_tokens
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// Registers everything under `orchestrator_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("orchestrator");
        r.register(
            "prefill_requests",
            "Prefill legs of user requests by prefill worker and outcome",
            self.prefill_requests.clone(),
        );
        r.register(
            "prefill_seconds",
            "Wall time of a prefill leg",
            self.prefill_seconds.clone(),
        );
        r.register(
            "warm_prefill_workers",
            "Prefill workers a pre-warm request went through and that have not failed since",
            self.warm_prefill_workers.clone(),
        );
        r.register(
            "prewarms",
            "Pre-warm attempts by outcome",
            self.prewarms.clone(),
        );
        r.register(
            "concurrent_fallbacks",
            "Concurrent handoffs that read the KV by the prefill's answer after the early read failed",
            self.concurrent_fallbacks.clone(),
        );
        r.register(
            "first_token_from_prefill",
            "Requests that asked the prefill leg for its first token, by outcome (used, missing, unusable)",
            self.first_tokens.clone(),
        );
    }
}
