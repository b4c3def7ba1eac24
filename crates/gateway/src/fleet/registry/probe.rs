//! Active health checks: `GET /health` on every registered worker each `--probe-interval`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;

use super::{Registry, Worker};
use crate::error::error_chain;
use crate::fleet::identity::{Identity, Instance, Refusal};

/// What a probe checks besides health: that the worker is not a gateway it must not
/// route to (this one, or another without `--allow-gateway-workers`).
#[derive(Debug, Clone)]
pub struct IdentityCheck {
    /// This gateway.
    pub instance: Instance,
    /// `--allow-gateway-workers`.
    pub allow_gateways: bool,
}

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
    identity: IdentityCheck,
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
            round(&registry, &client, settings.timeout, &identity).await;
        }
    }))
}

/// One probe round: every worker at once, results applied as they are known. A worker
/// that answers as a gateway it must not route to is removed from the roster.
pub async fn round(
    registry: &Registry,
    client: &reqwest::Client,
    timeout: Duration,
    identity: &IdentityCheck,
) {
    let roster = registry.snapshot();
    let probes = roster
        .members()
        .iter()
        .map(|m| probe(client, m.worker.clone(), timeout, identity));
    for (worker, outcome) in join_all(probes).await {
        match outcome {
            Ok(()) => registry.record_probe_passed(&worker),
            Err(ProbeFailure::Draining) => registry.record_draining(&worker, true),
            Err(ProbeFailure::Unhealthy(why)) => {
                tracing::debug!(url = %worker.base, "health probe failed: {why}");
                registry.record_failure(&worker, false, &why);
            }
            Err(ProbeFailure::Refused(refusal)) => {
                tracing::warn!("removing a worker: {refusal}");
                registry
                    .metrics
                    .inc_workers_refused("probe", refusal.reason());
                registry.unregister(&worker.base);
            }
        }
    }
    registry.forget_expired(Instant::now());
}

/// Why a probe failed.
enum ProbeFailure {
    /// No healthy answer.
    Unhealthy(String),
    /// A 503 whose body says `"reason": "draining"` (a pdserve worker shutting down).
    Draining,
    /// The URL answers as a gateway this one must not route to.
    Refused(Refusal),
}

async fn probe(
    client: &reqwest::Client,
    worker: Arc<Worker>,
    timeout: Duration,
    identity: &IdentityCheck,
) -> (Arc<Worker>, Result<(), ProbeFailure>) {
    let request = client
        .get(worker.health_url().clone())
        .timeout(timeout)
        .send();
    let unhealthy = |why| Err(ProbeFailure::Unhealthy(why));
    let outcome = match tokio::time::timeout(timeout, request).await {
        Err(_) => unhealthy(format!("/health did not answer within {timeout:?}")),
        Ok(Err(e)) => unhealthy(format!("/health failed: {}", error_chain(&e))),
        Ok(Ok(r)) => match Identity::from_headers(r.headers(), &identity.instance).admit(
            &worker.base,
            &identity.instance,
            identity.allow_gateways,
        ) {
            Err(refusal) => Err(ProbeFailure::Refused(refusal)),
            Ok(()) if r.status().is_success() => Ok(()),
            Ok(()) => {
                let status = r.status();
                match tokio::time::timeout(timeout, r.bytes()).await {
                    Ok(Ok(body)) if says_draining(&body) => Err(ProbeFailure::Draining),
                    _ => unhealthy(format!("/health answered {status}")),
                }
            }
        },
    };
    (worker, outcome)
}

/// Whether a failed `/health` body is a pdserve worker's `{"reason": "draining"}`.
fn says_draining(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Unhealthy<'a> {
        #[serde(borrow)]
        reason: Option<&'a str>,
    }
    serde_json::from_slice::<Unhealthy<'_>>(body).is_ok_and(|u| u.reason == Some("draining"))
}

#[cfg(test)]
mod tests {
    use super::says_draining;

    #[test]
    fn only_a_draining_reason_is_draining() {
        assert!(says_draining(
            br#"{"status":"unavailable","reason":"draining","message":"m"}"#
        ));
        assert!(!says_draining(
            br#"{"status":"unavailable","reason":"scheduler_wedged"}"#
        ));
        assert!(!says_draining(b"draining"));
        assert!(!says_draining(b""));
    }
}
