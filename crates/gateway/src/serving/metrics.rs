//! The request path's own Prometheus families: requests by route and status, leg
//! latencies, retries, how requests crossed the workers, streams, conversations and the
//! encoder stage. Registered into the gateway's registry by the composition root.

use std::sync::Arc;
use std::time::Duration;

use pdserve_protocol::WorkerRole;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::observe::history::{History, Series};

/// Labels of `requests_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteStatus {
    route: String,
    status: u16,
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

/// Labels of the history store's calls.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HistoryLabels {
    op: &'static str,
}

/// Labels of per-route latency.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

/// Labels of `routing_decision_seconds`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    role: &'static str,
    policy: &'static str,
}

/// Routing-decision buckets from 1 µs to about 8 s: a decision over a large fleet's
/// indexes takes tens of microseconds, so 8 to 64 µs go in steps of 4 (a p99 read against a
/// 50 µs goal needs more than doubling buckets), then doubling, so a slow one still lands
/// in a bucket.
fn decision_histogram() -> Histogram {
    let fine = [1, 2, 4].into_iter().chain((8..=64).step_by(4));
    let coarse = [80, 96, 112, 128]
        .into_iter()
        .chain((8..=23).map(|octave| 1 << octave));
    Histogram::new(fine.chain(coarse).map(|us| f64::from(us) * 1e-6))
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

/// The request path's counters and histograms (and the dashboard's leg series, which
/// the leg latencies also feed).
#[derive(Debug)]
pub struct ServingMetrics {
    requests: Family<RouteStatus, Counter>,
    prefill_seconds: Histogram,
    decode_ttfb_seconds: Histogram,
    end_to_end_seconds: Family<RouteLabels, Histogram, fn() -> Histogram>,
    decode_retries: Counter,
    retries: Family<RetryLabels, Counter>,
    disaggregation: Family<DisaggLabels, Counter>,
    stream_errors: Counter,
    first_token_from_prefill: Counter,
    first_token_mismatch: Counter,
    conversation_hits: Counter,
    conversation_misses: Counter,
    conversation_fallbacks: Counter,
    epd_stage_seconds: Family<StageLabels, Histogram, fn() -> Histogram>,
    routing_decision_seconds: Family<DecisionLabels, Histogram, fn() -> Histogram>,
    encoder_sub_requests: Counter,
    encoder_reencodes: Counter,
    history: Arc<History>,
    history_seconds: Family<HistoryLabels, Histogram>,
    history_failures: Family<HistoryLabels, Counter>,
}

impl ServingMetrics {
    /// The families, registered in `registry`; leg latencies are also sampled into
    /// `history`.
    pub fn register(registry: &mut Registry, history: Arc<History>) -> Self {
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
        let history_seconds =
            Family::<HistoryLabels, Histogram>::new_with_constructor(stage_histogram);
        registry.register(
            "history_seconds",
            "Calls to the history store (--history-backend) by kind: a turn's read of its \
             conversation, and its write once answered",
            history_seconds.clone(),
        );
        let history_failures = Family::<HistoryLabels, Counter>::default();
        registry.register(
            "history_failures",
            "History store calls that failed or timed out, by kind",
            history_failures.clone(),
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
        let routing_decision_seconds: Family<DecisionLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(decision_histogram);
        registry.register(
            "routing_decision_seconds",
            "Time the routing policy took to choose a worker, by role and policy (the \
             candidates' indexes read, their loads weighed)",
            routing_decision_seconds.clone(),
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
        Self {
            requests,
            prefill_seconds,
            decode_ttfb_seconds,
            end_to_end_seconds,
            decode_retries,
            retries,
            disaggregation,
            stream_errors,
            first_token_from_prefill,
            first_token_mismatch,
            conversation_hits,
            conversation_misses,
            conversation_fallbacks,
            epd_stage_seconds,
            routing_decision_seconds,
            encoder_sub_requests,
            encoder_reencodes,
            history,
            history_seconds,
            history_failures,
        }
    }

    /// Times a history store call of kind `op` (`read`, `write`) and counts its failure.
    pub fn observe_history(&self, op: &'static str, took: std::time::Duration, ok: bool) {
        let labels = HistoryLabels { op };
        self.history_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if !ok {
            self.history_failures.get_or_create(&labels).inc();
        }
    }

    /// The dashboard's history, which finished requests are filed into.
    pub fn history(&self) -> &Arc<History> {
        &self.history
    }

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
        self.history.observe(Series::Prefill, d);
    }

    /// Records a decode leg's time to first byte.
    pub fn observe_decode_ttfb(&self, d: Duration) {
        self.decode_ttfb_seconds.observe(d.as_secs_f64());
        self.history.observe(Series::DecodeTtfb, d);
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

    /// Records how long `policy` took to choose a worker of `role`.
    pub fn observe_routing_decision(&self, role: WorkerRole, policy: &'static str, d: Duration) {
        self.routing_decision_seconds
            .get_or_create(&DecisionLabels {
                role: role.as_str(),
                policy,
            })
            .observe(d.as_secs_f64());
    }

    /// Counts sub-requests sent to encode workers.
    pub fn inc_encoder_sub_requests(&self, n: u64) {
        self.encoder_sub_requests.inc_by(n);
    }

    /// Counts a request encoded again after a later stage failed.
    pub fn inc_encoder_reencodes(&self) {
        self.encoder_reencodes.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_the_request_families() {
        let mut registry = Registry::with_prefix("pdserve_gateway");
        let m = ServingMetrics::register(&mut registry, Arc::default());
        m.record_request("/v1/chat/completions", 200);
        m.observe_prefill(Duration::from_millis(3));
        m.observe_decode_ttfb(Duration::from_millis(4));
        m.observe_end_to_end("/v1/chat/completions", Duration::from_millis(5));
        m.inc_retries("decode", "unreachable");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for needle in [
            r#"pdserve_gateway_requests_total{route="/v1/chat/completions",status="200"} 1"#,
            "pdserve_gateway_prefill_seconds_count 1",
            "pdserve_gateway_decode_ttfb_seconds_count 1",
            r#"pdserve_gateway_request_seconds_count{route="/v1/chat/completions"} 1"#,
            "pdserve_gateway_decode_retries_total 1",
            r#"pdserve_gateway_retries_total{leg="decode",reason="unreachable"} 1"#,
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
