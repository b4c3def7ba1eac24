//! Prometheus metrics: requests by route and status, in-flight requests per worker and
//! latency histograms per leg.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of `requests_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteStatus {
    route: String,
    status: u16,
}

/// Labels of per-role worker metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleLabels {
    role: String,
}

/// Labels of `retries_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RetryLabels {
    leg: String,
    reason: String,
}

/// Labels of `disaggregation_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DisaggLabels {
    outcome: String,
}

/// Labels of per-route latency.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

/// Labels of the encoder-disaggregation stage timings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StageLabels {
    stage: String,
}

/// Stage buckets from 0.1 ms (the rewrite takes microseconds) to about 840 s.
fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 24))
}

/// Latency buckets from 1 ms to about 550 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// The gateway's metrics and the registry that exports them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteStatus, Counter>,
    prefill_seconds: Histogram,
    decode_ttfb_seconds: Histogram,
    end_to_end_seconds: Family<RouteLabels, Histogram, fn() -> Histogram>,
    decode_retries: Counter,
    retries: Family<RetryLabels, Counter>,
    policy_cache_hits: Family<RoleLabels, Gauge>,
    policy_cache_misses: Family<RoleLabels, Gauge>,
    policy_cache_hit_ratio: Family<RoleLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    policy_tree_bytes: Family<RoleLabels, Gauge>,
    disaggregation: Family<DisaggLabels, Counter>,
    stream_errors: Counter,
    first_token_from_prefill: Counter,
    first_token_mismatch: Counter,
    conversation_hits: Counter,
    conversation_misses: Counter,
    conversation_fallbacks: Counter,
    epd_stage_seconds: Family<StageLabels, Histogram, fn() -> Histogram>,
    encoder_sub_requests: Counter,
    encoder_reencodes: Counter,
    /// The fleet's families: roster, evictions, per-worker gauges.
    pub fleet: std::sync::Arc<crate::fleet::registry::FleetMetrics>,
    /// Routing loops refused.
    pub loops: std::sync::Arc<crate::ingress::hops::LoopMetrics>,
    /// The KV-event subscribers' families.
    pub kv_events: std::sync::Arc<crate::fleet::kv_events::KvEventMetrics>,
    /// The load scraper's failures.
    pub load: std::sync::Arc<crate::fleet::load::LoadMetrics>,
    /// Overload control: queue depth, wait, rejections.
    pub admission: std::sync::Arc<crate::ingress::admission::AdmissionMetrics>,
    /// The dashboard's per-second samples and recent requests.
    pub history: std::sync::Arc<crate::observe::history::History>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("pdserve_gateway");
        let requests = Family::<RouteStatus, Counter>::default();
        registry.register(
            "requests",
            "Client requests by route and response status",
            requests.clone(),
        );
        let prefill_seconds = latency_histogram();
        registry.register(
            "prefill_seconds",
            "Prefill leg duration, request sent to response read",
            prefill_seconds.clone(),
        );
        let decode_ttfb_seconds = latency_histogram();
        registry.register(
            "decode_ttfb_seconds",
            "Decode (or aggregated) leg time to first byte",
            decode_ttfb_seconds.clone(),
        );
        let end_to_end_seconds: Family<RouteLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "request_seconds",
            "End-to-end request duration, until the last byte of the response",
            end_to_end_seconds.clone(),
        );
        let decode_retries = Counter::default();
        registry.register(
            "decode_retries",
            "Decode legs retried on another worker after failing before the first byte",
            decode_retries.clone(),
        );
        let retries = Family::<RetryLabels, Counter>::default();
        registry.register(
            "retries",
            "Legs retried on another worker before the first byte, by leg and by what failed",
            retries.clone(),
        );
        let policy_cache_hits = Family::<RoleLabels, Gauge>::default();
        registry.register(
            "policy_cache_hits",
            "cache_aware decisions that followed a prefix match above --cache-threshold, per role",
            policy_cache_hits.clone(),
        );
        let policy_cache_misses = Family::<RoleLabels, Gauge>::default();
        registry.register(
            "policy_cache_misses",
            "cache_aware decisions without a match above --cache-threshold, per role",
            policy_cache_misses.clone(),
        );
        let policy_cache_hit_ratio =
            Family::<RoleLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "policy_cache_hit_ratio",
            "cache_aware hits / (hits + misses), per role",
            policy_cache_hit_ratio.clone(),
        );
        let policy_tree_bytes = Family::<RoleLabels, Gauge>::default();
        registry.register(
            "policy_tree_bytes",
            "Approximate bytes held by cache_aware prefix trees, per role (capped by --max-tree-size per worker)",
            policy_tree_bytes.clone(),
        );
        let disaggregation = Family::<DisaggLabels, Counter>::default();
        registry.register(
            "disaggregation",
            "Requests by how they crossed the workers: disaggregated (prefill then decode), \
             prefill_skipped (short uncached prompt sent straight to decode), aggregated",
            disaggregation.clone(),
        );
        let stream_errors = Counter::default();
        registry.register(
            "stream_errors",
            "Streams ended with an error event after the first byte",
            stream_errors.clone(),
        );
        let first_token_from_prefill = Counter::default();
        registry.register(
            "first_token_from_prefill",
            "Streams whose first token the client got from the prefill leg's answer",
            first_token_from_prefill.clone(),
        );
        let first_token_mismatch = Counter::default();
        registry.register(
            "first_token_mismatch",
            "Streams ended with an error event because the decode worker did not generate \
             the first token the prefill leg had sent",
            first_token_mismatch.clone(),
        );
        let conversation_hits = Counter::default();
        registry.register(
            "conversation_cache_hits",
            "Turns whose prefill read the previous turn's decode KV",
            conversation_hits.clone(),
        );
        let conversation_misses = Counter::default();
        registry.register(
            "conversation_cache_misses",
            "Turns with a conversation_id but no usable cached decode KV",
            conversation_misses.clone(),
        );
        let conversation_fallbacks = Counter::default();
        registry.register(
            "conversation_cache_fallbacks",
            "Turns whose prefill failed reading the previous turn's decode KV and were \
             prefilled in full instead",
            conversation_fallbacks.clone(),
        );
        let epd_stage_seconds: Family<StageLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(stage_histogram);
        registry.register(
            "epd_stage_seconds",
            "Encoder-disaggregated requests by stage: encode (all encoder sub-requests), \
             rewrite, prefill, decode_ttfb (final leg to its first byte) and total (arrival \
             to the final leg's first byte)",
            epd_stage_seconds.clone(),
        );
        let encoder_sub_requests = Counter::default();
        registry.register(
            "encoder_sub_requests",
            "Sub-requests sent to encode workers",
            encoder_sub_requests.clone(),
        );
        let encoder_reencodes = Counter::default();
        registry.register(
            "encoder_reencodes",
            "Requests encoded again because a later stage failed before its first byte \
             (a decode 500: the embedding could not be fetched)",
            encoder_reencodes.clone(),
        );
        let fleet = std::sync::Arc::new(crate::fleet::registry::FleetMetrics::register(
            &mut registry,
        ));
        let loops = std::sync::Arc::new(crate::ingress::hops::LoopMetrics::register(&mut registry));
        let kv_events = std::sync::Arc::new(crate::fleet::kv_events::KvEventMetrics::register(
            &mut registry,
        ));
        let load = std::sync::Arc::new(crate::fleet::load::LoadMetrics::register(&mut registry));
        let admission = std::sync::Arc::new(crate::ingress::admission::AdmissionMetrics::register(
            &mut registry,
        ));
        Self {
            registry,
            history: Default::default(),
            fleet,
            loops,
            kv_events,
            load,
            admission,
            epd_stage_seconds,
            encoder_sub_requests,
            encoder_reencodes,
            requests,
            prefill_seconds,
            decode_ttfb_seconds,
            end_to_end_seconds,
            decode_retries,
            retries,
            policy_cache_hits,
            policy_cache_misses,
            policy_cache_hit_ratio,
            policy_tree_bytes,
            disaggregation,
            stream_errors,
            first_token_from_prefill,
            first_token_mismatch,
            conversation_hits,
            conversation_misses,
            conversation_fallbacks,
        }
    }
}

impl Metrics {
    /// Counts one answered request.
    pub fn record_request(&self, route: &str, status: u16) {
        self.requests
            .get_or_create(&RouteStatus {
                route: route.to_string(),
                status,
            })
            .inc();
    }

    /// Records a finished prefill leg.
    pub fn observe_prefill(&self, d: Duration) {
        self.prefill_seconds.observe(d.as_secs_f64());
        self.history
            .observe(crate::observe::history::Series::Prefill, d);
    }

    /// Records a decode leg's time to first byte.
    pub fn observe_decode_ttfb(&self, d: Duration) {
        self.decode_ttfb_seconds.observe(d.as_secs_f64());
        self.history
            .observe(crate::observe::history::Series::DecodeTtfb, d);
    }

    /// Records a request's end-to-end duration.
    pub fn observe_end_to_end(&self, route: &str, d: Duration) {
        self.end_to_end_seconds
            .get_or_create(&RouteLabels {
                route: route.to_string(),
            })
            .observe(d.as_secs_f64());
    }

    /// Counts a retry of `leg` after a failure of kind `reason`.
    pub fn inc_retries(&self, leg: &str, reason: &str) {
        if leg == "decode" {
            self.decode_retries.inc();
        }
        self.retries
            .get_or_create(&RetryLabels {
                leg: leg.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Publishes a role's routing-policy counters (read from the policy at scrape time).
    pub fn set_policy_stats(&self, role: &str, hits: u64, misses: u64, tree_bytes: usize) {
        let labels = RoleLabels {
            role: role.to_string(),
        };
        self.policy_cache_hits
            .get_or_create(&labels)
            .set(hits as i64);
        self.policy_cache_misses
            .get_or_create(&labels)
            .set(misses as i64);
        let decided = hits + misses;
        let ratio = if decided == 0 {
            0.0
        } else {
            hits as f64 / decided as f64
        };
        self.policy_cache_hit_ratio
            .get_or_create(&labels)
            .set(ratio);
        self.policy_tree_bytes
            .get_or_create(&labels)
            .set(tree_bytes as i64);
    }

    /// Counts how a request crossed the workers.
    pub fn record_disaggregation(&self, outcome: &str) {
        self.disaggregation
            .get_or_create(&DisaggLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts a stream that ended with an error event.
    pub fn inc_stream_errors(&self) {
        self.stream_errors.inc();
    }

    /// Counts a stream whose first token came from the prefill leg.
    pub fn inc_first_token_from_prefill(&self) {
        self.first_token_from_prefill.inc();
    }

    /// Counts a decode stream that did not continue from the first token sent.
    pub fn inc_first_token_mismatch(&self) {
        self.first_token_mismatch.inc();
    }

    /// Counts a conversation cache lookup.
    pub fn record_conversation_lookup(&self, hit: bool) {
        if hit {
            self.conversation_hits.inc();
        } else {
            self.conversation_misses.inc();
        }
    }

    /// Counts a turn prefilled in full after reading the last turn's KV failed.
    pub fn record_conversation_fallback(&self) {
        self.conversation_fallbacks.inc();
    }

    /// Records one stage of an encoder-disaggregated request.
    pub fn observe_epd_stage(&self, stage: &str, d: Duration) {
        self.epd_stage_seconds
            .get_or_create(&StageLabels {
                stage: stage.to_string(),
            })
            .observe(d.as_secs_f64());
    }

    /// Counts sub-requests sent to encoders.
    pub fn inc_encoder_sub_requests(&self, n: u64) {
        self.encoder_sub_requests.inc_by(n);
    }

    /// Counts a request encoded again after a later stage failed.
    pub fn inc_encoder_reencodes(&self) {
        self.encoder_reencodes.inc();
    }

    /// All metrics in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_all_families() {
        let m = Metrics::default();
        m.record_request("/v1/chat/completions", 200);
        let g = m.fleet.worker_in_flight("decode", "http://127.0.0.1:1");
        g.inc();
        m.observe_prefill(Duration::from_millis(3));
        m.observe_decode_ttfb(Duration::from_millis(4));
        m.observe_end_to_end("/v1/chat/completions", Duration::from_millis(5));
        let text = m.encode();
        for needle in [
            r#"pdserve_gateway_requests_total{route="/v1/chat/completions",status="200"} 1"#,
            r#"pdserve_gateway_worker_in_flight{role="decode",worker="http://127.0.0.1:1"} 1"#,
            "pdserve_gateway_prefill_seconds_count 1",
            "pdserve_gateway_decode_ttfb_seconds_count 1",
            r#"pdserve_gateway_request_seconds_count{route="/v1/chat/completions"} 1"#,
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
