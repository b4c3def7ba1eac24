//! Round-robin: each role's workers in turn.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use super::{role_index, Policy, RouteRequest};
use crate::fleet::registry::Worker;

/// One cursor per role that only ever advances, so a roster change never sends the next
/// burst of requests to the first worker again.
#[derive(Debug, Default)]
pub struct RoundRobin {
    cursors: [AtomicUsize; 4],
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        _request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        if candidates.is_empty() {
            return None;
        }
        let turn = self.cursors[role_index(role)].fetch_add(1, Ordering::Relaxed);
        Some(candidates[turn % candidates.len()].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use crate::fleet::registry::WorkerSpec;
    use prometheus_client::metrics::gauge::Gauge;

    fn workers(ports: &[u16]) -> Vec<Arc<Worker>> {
        ports
            .iter()
            .map(|p| {
                let url = reqwest::Url::parse(&format!("http://127.0.0.1:{p}")).unwrap();
                Arc::new(Worker::new(
                    WorkerSpec::new(WorkerRole::Decode, url),
                    Gauge::default(),
                ))
            })
            .collect()
    }

    #[test]
    fn rotates_per_role_and_never_restarts() {
        let rr = RoundRobin::default();
        let headers = http::HeaderMap::new();
        let ctx = RouteRequest::bodyless(Endpoint::Chat, &headers);
        let ws = workers(&[1, 2, 3]);
        let pick = |role, ws: &[Arc<Worker>]| rr.select(role, ws, &ctx).unwrap().base.clone();
        let picks: Vec<_> = (0..4).map(|_| pick(WorkerRole::Decode, &ws)).collect();
        assert_eq!(
            picks,
            [
                "http://127.0.0.1:1",
                "http://127.0.0.1:2",
                "http://127.0.0.1:3",
                "http://127.0.0.1:1"
            ]
        );
        assert_eq!(pick(WorkerRole::Decode, &ws), "http://127.0.0.1:2");
        // Another role has its own cursor.
        assert_eq!(pick(WorkerRole::Prefill, &ws), "http://127.0.0.1:1");
        // After a roster change the cursor continues instead of restarting at the first.
        let grown = workers(&[1, 2, 3, 4]);
        assert_eq!(pick(WorkerRole::Decode, &grown), "http://127.0.0.1:2");
        assert!(rr.select(WorkerRole::Decode, &[], &ctx).is_none());
    }
}
