//! The fleet's own metrics: the roster by health, evictions and re-admissions, each
//! worker's in-flight and circuit gauges, the requests refused for want of a worker, and
//! the worker URLs refused. The registry is
//! handed these families; it knows nothing else of the gateway's metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of per-worker metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    role: String,
    worker: String,
}

/// Labels of per-role counters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleLabels {
    role: String,
}

/// Labels of the worker count gauge.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleHealthLabels {
    role: String,
    health: String,
}

/// Labels of `workers_refused_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusedWorkerLabels {
    source: String,
    reason: String,
}

/// Labels of `refused_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleReasonLabels {
    role: String,
    reason: String,
}

/// Labels of `discovery_errors_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabels {
    source: String,
}

/// The fleet's families, registered in the gateway's metrics registry.
#[derive(Debug, Default)]
pub struct FleetMetrics {
    worker_in_flight: Family<WorkerLabels, Gauge>,
    worker_circuit: Family<WorkerLabels, Gauge>,
    workers: Family<RoleHealthLabels, Gauge>,
    evictions: Family<RoleLabels, Counter>,
    readmissions: Family<RoleLabels, Counter>,
    panic_routed: Family<RoleLabels, Counter>,
    refused: Family<RoleReasonLabels, Counter>,
    workers_refused: Family<RefusedWorkerLabels, Counter>,
    discovery_errors: Family<SourceLabels, Counter>,
}

impl FleetMetrics {
    /// The families, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "worker_in_flight",
            "Requests open on each upstream worker",
            m.worker_in_flight.clone(),
        );
        registry.register(
            "worker_circuit_state",
            "Each worker's circuit breaker: 0 closed, 1 open, 2 half-open (trial on its way)",
            m.worker_circuit.clone(),
        );
        registry.register(
            "workers",
            "Registered workers by role and health (live or evicted)",
            m.workers.clone(),
        );
        registry.register(
            "worker_evictions",
            "Workers evicted after failed health probes or refused connections",
            m.evictions.clone(),
        );
        registry.register(
            "worker_readmissions",
            "Evicted workers re-admitted after a healthy probe or a successful request",
            m.readmissions.clone(),
        );
        registry.register(
            "panic_routed",
            "Requests routed to an evicted worker, or to one whose circuit breaker is open, \
             because no worker of the role was healthy (panic routing: trying beats \
             refusing; a success re-admits the worker or closes its breaker)",
            m.panic_routed.clone(),
        );
        registry.register(
            "refused",
            "Requests answered 503 because no worker of the role could take them, by the \
             state that kept them out: no_worker (none registered), evicted, breaker_open \
             or draining",
            m.refused.clone(),
        );
        registry.register(
            "workers_refused",
            "Worker URLs refused because they answer as this gateway (reason self) or as \
             another pdserve gateway without --allow-gateway-workers (reason gateway), by \
             where the URL came from (registration, static, probe, discovery)",
            m.workers_refused.clone(),
        );
        registry.register(
            "discovery_errors",
            "Looks at a discovery source that failed (unreadable or malformed file, ...): \
             the workers it found last are kept",
            m.discovery_errors.clone(),
        );
        m
    }

    /// The in-flight gauge of one worker (shared; clone it once and keep it).
    pub fn worker_in_flight(&self, role: &str, worker: &str) -> Gauge {
        self.worker_in_flight
            .get_or_create(&worker_labels(role, worker))
            .clone()
    }

    /// The circuit-state gauge of one worker.
    pub fn worker_circuit_state(&self, role: &str, worker: &str) -> Gauge {
        self.worker_circuit
            .get_or_create(&worker_labels(role, worker))
            .clone()
    }

    /// Stops exporting a removed worker's series, so registration churn cannot grow
    /// `/metrics` without bound.
    pub fn forget_worker(&self, role: &str, worker: &str) {
        let labels = worker_labels(role, worker);
        self.worker_in_flight.remove(&labels);
        self.worker_circuit.remove(&labels);
    }

    /// Sets the number of live and evicted workers of `role`.
    pub fn set_workers(&self, role: &str, live: i64, evicted: i64) {
        for (health, n) in [("live", live), ("evicted", evicted)] {
            self.workers
                .get_or_create(&RoleHealthLabels {
                    role: role.to_string(),
                    health: health.to_string(),
                })
                .set(n);
        }
    }

    /// Counts an eviction.
    pub fn inc_evictions(&self, role: &str) {
        self.evictions.get_or_create(&role_labels(role)).inc();
    }

    /// Counts a re-admission.
    pub fn inc_readmissions(&self, role: &str) {
        self.readmissions.get_or_create(&role_labels(role)).inc();
    }

    /// Counts a request routed to an evicted worker (no worker of `role` was healthy).
    pub fn inc_panic_routed(&self, role: &str) {
        self.panic_routed.get_or_create(&role_labels(role)).inc();
    }

    /// Counts a request refused because no worker of `role` could take it.
    pub fn inc_refused(&self, role: &str, reason: &str) {
        self.refused
            .get_or_create(&RoleReasonLabels {
                role: role.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a worker URL refused for answering as a gateway (`self` or `gateway`),
    /// by where it came from.
    pub fn inc_workers_refused(&self, source: &str, reason: &str) {
        self.workers_refused
            .get_or_create(&RefusedWorkerLabels {
                source: source.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a failed look at the discovery `source`.
    pub fn inc_discovery_errors(&self, source: &str) {
        self.discovery_errors
            .get_or_create(&SourceLabels {
                source: source.to_string(),
            })
            .inc();
    }
}

fn worker_labels(role: &str, worker: &str) -> WorkerLabels {
    WorkerLabels {
        role: role.to_string(),
        worker: worker.to_string(),
    }
}

fn role_labels(role: &str) -> RoleLabels {
    RoleLabels {
        role: role.to_string(),
    }
}
