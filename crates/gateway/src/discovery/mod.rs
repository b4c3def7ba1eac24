//! Workers discovered rather than typed into flags. Each source feeds the one registry
//! through [`Registry::sync_source`](crate::registry::Registry::sync_source), so
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

use tokio::task::JoinHandle;

use crate::identity::identify;
use crate::registry::{WorkerSource, WorkerSpec};
use crate::state::AppState;
pub use args::{
    parse_dns_target, DiscoveryArgs, DiscoveryConfig, DnsTarget, KubernetesDiscovery,
    LabelSelector, DEFAULT_BOOTSTRAP_PORT_ANNOTATION, DEFAULT_KV_EVENTS_PORT_ANNOTATION,
    DP_SIZE_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION, PORT_ANNOTATION,
};

/// Starts the discovery tasks the configuration asks for; they run until aborted.
pub fn spawn(state: &Arc<AppState>) -> Vec<JoinHandle<()>> {
    let config = &state.config.discovery;
    let mut tasks = Vec::new();
    if let Some(path) = config.file.clone() {
        tasks.push(tokio::spawn(file::watch(state.clone(), path)));
    }
    if !config.dns.is_empty() {
        tasks.push(tokio::spawn(dns::watch(
            state.clone(),
            config.dns.clone(),
            config.dns_server,
        )));
    }
    if let Some(kubernetes) = config.kubernetes.clone() {
        tasks.push(tokio::spawn(kubernetes::watch(state.clone(), kubernetes)));
    }
    tasks
}

/// Checks a KV-event publisher address: `tcp://host:port`, as vLLM's ZMQ endpoints are
/// written.
pub fn check_kv_events_endpoint(endpoint: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(endpoint).ok();
    match parsed {
        Some(url) if url.scheme() == "tcp" && url.host_str().is_some() && url.port().is_some() => {
            Ok(())
        }
        _ => Err(format!(
            "`kv_events_endpoint` must be tcp://host:port, got `{endpoint}`"
        )),
    }
}

/// A source that could not be read: the workers it registered stay as they are.
pub(crate) fn failed(state: &AppState, source: WorkerSource, why: &str) {
    state.metrics.inc_discovery_errors(source.as_str());
    tracing::warn!(%source, "discovery failed, keeping the workers it found last: {why}");
}

/// Makes `source`'s workers `specs`, leaving out URLs that answer as a gateway this one
/// must not route to (asked once, when a URL first appears).
pub(crate) async fn apply(state: &AppState, source: WorkerSource, specs: Vec<WorkerSpec>) {
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
            let identity = identify(
                state.client.pooled(),
                &spec.url,
                &state.instance,
                state.config.probe.timeout,
            )
            .await;
            match identity.admit(&key, &state.instance, state.config.allow_gateway_workers) {
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
