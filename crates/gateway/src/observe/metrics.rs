//! The gateway's Prometheus registry: every component's families (fleet, loops, KV
//! events, load, admission; the request path's are registered into it by the
//! composition root) and the routing policies' gauges, exported in the text format.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of per-role worker metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleLabels {
    role: String,
}

/// The gateway's metrics and the registry that exports them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Families named outside `pdserve_gateway_` (the planner's `pdserve_planner_*`).
    unprefixed: Registry,
    policy_cache_hits: Family<RoleLabels, Gauge>,
    policy_cache_misses: Family<RoleLabels, Gauge>,
    policy_cache_hit_ratio: Family<RoleLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    policy_tree_bytes: Family<RoleLabels, Gauge>,
    /// The fleet's families: roster, evictions, per-worker gauges.
    pub fleet: Arc<crate::fleet::registry::FleetMetrics>,
    /// Routing loops refused.
    pub loops: Arc<crate::ingress::hops::LoopMetrics>,
    /// The KV-event subscribers' families.
    pub kv_events: Arc<crate::fleet::kv_events::KvEventMetrics>,
    /// The load scraper's failures.
    pub load: Arc<crate::fleet::load::LoadMetrics>,
    /// Overload control: queue depth, wait, rejections.
    pub admission: Arc<crate::ingress::admission::AdmissionMetrics>,
    /// The dashboard's per-second samples and recent requests.
    pub history: Arc<crate::observe::history::History>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("pdserve_gateway");
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
        let fleet = Arc::new(crate::fleet::registry::FleetMetrics::register(
            &mut registry,
        ));
        let loops = Arc::new(crate::ingress::hops::LoopMetrics::register(&mut registry));
        let kv_events = Arc::new(crate::fleet::kv_events::KvEventMetrics::register(
            &mut registry,
        ));
        let load = Arc::new(crate::fleet::load::LoadMetrics::register(&mut registry));
        let admission = Arc::new(crate::ingress::admission::AdmissionMetrics::register(
            &mut registry,
        ));
        Self {
            registry,
            unprefixed: Registry::default(),
            history: Default::default(),
            fleet,
            loops,
            kv_events,
            load,
            admission,
            policy_cache_hits,
            policy_cache_misses,
            policy_cache_hit_ratio,
            policy_tree_bytes,
        }
    }
}

impl Metrics {
    /// The registry, for a component that registers its own families (before this is
    /// shared).
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The registry of families that name their own prefix.
    pub fn unprefixed_mut(&mut self) -> &mut Registry {
        &mut self.unprefixed
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

    /// All metrics in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &self.unprefixed);
        let _ = encode_eof(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_the_components_families() {
        let m = Metrics::default();
        let g = m.fleet.worker_in_flight("decode", "http://127.0.0.1:1");
        g.inc();
        m.set_policy_stats("decode", 3, 1, 10);
        let text = m.encode();
        for needle in [
            r#"pdserve_gateway_worker_in_flight{role="decode",worker="http://127.0.0.1:1"} 1"#,
            r#"pdserve_gateway_policy_cache_hits{role="decode"} 3"#,
            r#"pdserve_gateway_policy_cache_hit_ratio{role="decode"} 0.75"#,
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
