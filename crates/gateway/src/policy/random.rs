//! Random: a uniformly chosen candidate.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;
use rand::Rng;

use super::{Policy, RouteRequest};
use crate::fleet::registry::Worker;

/// Picks each candidate with equal probability (stateless; the thread-local RNG does not
/// allocate).
#[derive(Debug, Default, Clone, Copy)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(
        &self,
        _role: WorkerRole,
        candidates: &[Arc<Worker>],
        _request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        match candidates.len() {
            0 => None,
            1 => Some(candidates[0].clone()),
            n => Some(candidates[rand::rng().random_range(0..n)].clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{chat, index_of, pick, workers};

    #[test]
    fn spreads_uniformly() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3, 4]);
        let request = chat("hi");
        let mut counts = [0usize; 4];
        for _ in 0..40_000 {
            let base = pick(&Random, WorkerRole::Decode, &ws, &request);
            counts[index_of(&ws, &base)] += 1;
        }
        // Expect 10000 each; the standard deviation is about 87, so ±600 never trips.
        for c in counts {
            assert!((9_400..=10_600).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn handles_one_and_no_candidates() {
        let ws = workers(WorkerRole::Decode, &[7]);
        let request = chat("hi");
        assert_eq!(
            pick(&Random, WorkerRole::Decode, &ws, &request),
            "http://127.0.0.1:7"
        );
        let headers = http::HeaderMap::new();
        let route = RouteRequest::bodyless(crate::endpoint::Endpoint::Chat, &headers);
        assert!(Random.select(WorkerRole::Decode, &[], &route).is_none());
    }
}
