//! Active health checks: `GET /health` on every registered worker each `--probe-interval`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;

use super::{Registry, Worker};
use crate::error::error_chain;

/// Probe timing (`--probe-interval`, `--probe-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct ProbeSettings {
    /// Time between probe rounds; zero turns probing off.
    pub interval: Duration,
    /// Time limit of one probe.
    pub timeout: Duration,
}

/// Probes every registered worker (live and evicted) each interval until the registry
/// is dropped. Returns `None` when probing is off.
pub fn spawn(
    registry: &Arc<Registry>,
    client: reqwest::Client,
    settings: ProbeSettings,
) -> Option<tokio::task::JoinHandle<()>> {
    if settings.interval.is_zero() {
        return None;
    }
    let registry = Arc::downgrade(registry);
    Some(tokio::spawn(async move {
        let mut ticks = tokio::time::interval(settings.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate; registered workers start live, so wait a period.
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(registry) = registry.upgrade() else {
                return;
            };
            round(&registry, &client, settings.timeout).await;
        }
    }))
}

/// One probe round: every worker at once, results applied as they are known.
pub async fn round(registry: &Registry, client: &reqwest::Client, timeout: Duration) {
    let roster = registry.snapshot();
    let probes = roster
        .members()
        .iter()
        .map(|m| probe(client, m.worker.clone(), timeout));
    for (worker, outcome) in join_all(probes).await {
        match outcome {
            Ok(()) => registry.record_success(&worker),
            Err(why) => {
                tracing::debug!(url = %worker.base, "health probe failed: {why}");
                registry.record_failure(&worker, false, &why);
            }
        }
    }
    registry.forget_expired(Instant::now());
}

async fn probe(
    client: &reqwest::Client,
    worker: Arc<Worker>,
    timeout: Duration,
) -> (Arc<Worker>, Result<(), String>) {
    let request = client
        .get(worker.health_url().clone())
        .timeout(timeout)
        .send();
    let outcome = match tokio::time::timeout(timeout, request).await {
        Err(_) => Err(format!("/health did not answer within {timeout:?}")),
        Ok(Err(e)) => Err(format!("/health failed: {}", error_chain(&e))),
        Ok(Ok(r)) if r.status().is_success() => Ok(()),
        Ok(Ok(r)) => Err(format!("/health answered {}", r.status())),
    };
    (worker, outcome)
}
