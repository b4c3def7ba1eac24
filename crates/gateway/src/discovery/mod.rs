//! Workers discovered rather than typed into flags. Each source feeds the one registry
//! through [`Registry::sync_source`](crate::registry::Registry::sync_source), so
//! probing, breakers, pre-warm and policies work the same whatever the source; a URL
//! that answers as a pdserve gateway is refused with a log line and a metric (a selector
//! or listing that also names gateways cannot make a loop).
//!
//! - [`file`]: `--discover-file`, a watched YAML or JSON listing.

pub mod file;

use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::identity::identify;
use crate::registry::{WorkerSource, WorkerSpec};
use crate::state::AppState;

/// Starts the discovery tasks the configuration asks for; they run until aborted.
pub fn spawn(state: &Arc<AppState>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let Some(path) = state.config.discover_file.clone() {
        tasks.push(tokio::spawn(watch_file(state.clone(), path)));
    }
    tasks
}

/// Re-reads `path` every `--discover-interval` and applies it when its text changed.
async fn watch_file(state: Arc<AppState>, path: PathBuf) {
    let mut ticks = tokio::time::interval(state.config.discover_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut applied: Option<String> = None;
    loop {
        ticks.tick().await;
        let text = match file::read(&path).await {
            Ok(text) => text,
            Err(why) => {
                failed(&state, WorkerSource::File, &why);
                continue;
            }
        };
        if applied.as_deref() == Some(text.as_str()) {
            continue;
        }
        match file::parse(&text) {
            Ok(specs) => {
                apply(&state, WorkerSource::File, specs).await;
                applied = Some(text);
            }
            Err(why) => failed(
                &state,
                WorkerSource::File,
                &format!("{}: {why}", path.display()),
            ),
        }
    }
}

/// A source that could not be read: the workers it registered stay as they are.
fn failed(state: &AppState, source: WorkerSource, why: &str) {
    state.metrics.inc_discovery_errors(source.as_str());
    tracing::warn!(%source, "discovery failed, keeping the workers it found last: {why}");
}

/// Makes `source`'s workers `specs`, leaving out URLs that answer as a gateway this one
/// must not route to (asked once, when a URL first appears).
async fn apply(state: &AppState, source: WorkerSource, specs: Vec<WorkerSpec>) {
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
