//! Workers discovered rather than typed into flags. Each source feeds the one registry
//! through [`Registry::sync_source`](crate::fleet::registry::Registry::sync_source), so
//! probing, breakers, pre-warm and policies work the same whatever the source; a URL
//! that answers as a pdserve gateway is refused with a log line and a metric (a selector
//! or listing that also names gateways cannot make a loop).
//!
//! - [`file`]: `--discover-file`, a watched YAML or JSON listing.
//! - [`dns`]: `--discover-dns`, names resolved every `--discover-interval`.
//! - [`kubernetes`]: `--service-discovery`, pods watched by label selector.

mod args;
pub mod dns;
pub mod file;
pub mod kubernetes;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::fleet::identity::WorkerCheck;
use crate::fleet::registry::{FleetMetrics, Registry, WorkerSource, WorkerSpec};
pub use args::{
    parse_dns_target, DiscoveryArgs, DiscoveryConfig, DnsTarget, KubernetesDiscovery,
    LabelSelector, DEFAULT_BOOTSTRAP_PORT_ANNOTATION, DEFAULT_KV_EVENTS_PORT_ANNOTATION,
    DP_SIZE_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION, PORT_ANNOTATION,
};

/// What the discovery tasks need of the gateway: the registry they feed, what they
/// check a new URL with (is it a gateway?), and their counters.
#[derive(Debug, Clone)]
pub struct Discoverer {
    /// The roster each source syncs its workers into.
    pub registry: Arc<Registry>,
    /// How a discovered URL is checked (never this gateway; another only when allowed);
    /// its timeout also bounds a DNS look-up.
    pub check: WorkerCheck,
    /// Discovery errors and refused URLs are counted here.
    pub metrics: Arc<FleetMetrics>,
    /// Time between two looks at a source (`--discover-interval`).
    pub interval: Duration,
}

/// Starts the discovery tasks `config` asks for; they run until aborted.
pub fn spawn(discoverer: Discoverer, config: &DiscoveryConfig) -> Vec<JoinHandle<()>> {
    let discoverer = Arc::new(discoverer);
    let mut tasks = Vec::new();
    if let Some(path) = config.file.clone() {
        tasks.push(tokio::spawn(file::watch(discoverer.clone(), path)));
    }
    if !config.dns.is_empty() {
        tasks.push(tokio::spawn(dns::watch(
            discoverer.clone(),
            config.dns.clone(),
            config.dns_server,
        )));
    }
    if let Some(kubernetes) = config.kubernetes.clone() {
        tasks.push(tokio::spawn(kubernetes::watch(discoverer, kubernetes)));
    }
    tasks
}

/// A source that could not be read: the workers it registered stay as they are.
pub(crate) fn failed(state: &Discoverer, source: WorkerSource, why: &str) {
    state.metrics.inc_discovery_errors(source.as_str());
    tracing::warn!(%source, "discovery failed, keeping the workers it found last: {why}");
}

/// Makes `source`'s workers `specs`, leaving out URLs that answer as a gateway this one
/// must not route to (asked once, when a URL first appears).
pub(crate) async fn apply(state: &Discoverer, source: WorkerSource, specs: Vec<WorkerSpec>) {
    let roster = state.registry.snapshot();
    // New URLs are asked all at once: a listing of many unreachable hosts costs one
    // probe timeout, not one each.
    let checks = specs.into_iter().map(|spec| {
        let known = roster.members().iter().any(|m| m.worker.base == spec.key());
        async move {
            if known {
                return Some(spec);
            }
            let key = spec.key();
            match state.check.admit(&spec.url, &key).await {
                Ok(()) => Some(spec),
                Err(refusal) => {
                    state
                        .metrics
                        .inc_workers_refused("discovery", refusal.reason());
                    tracing::warn!(%source, "not routing to a discovered URL: {refusal}");
                    None
                }
            }
        }
    });
    let accepted: Vec<WorkerSpec> = futures::future::join_all(checks)
        .await
        .into_iter()
        .flatten()
        .collect();
    let report = state.registry.sync_source(source, accepted);
    for (url, why) in &report.refused {
        tracing::warn!(%source, url, "discovered worker not taken: {why}");
    }
    if !(report.added.is_empty() && report.updated.is_empty() && report.removed.is_empty()) {
        tracing::info!(
            %source,
            added = ?report.added,
            updated = ?report.updated,
            removed = ?report.removed,
            "discovery changed the roster"
        );
    }
}
