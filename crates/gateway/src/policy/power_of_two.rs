//! Power of two choices: two distinct random candidates, the less loaded one.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;
use rand::Rng;

use super::{Policy, RouteRequest};
use crate::fleet::registry::Worker;

/// Samples two distinct candidates and keeps the less loaded one — by the load the
/// workers report (`--load-scrape-interval`), else this gateway's in-flight counts, which
/// also break ties (then the first sampled) — which avoids the herd behaviour of always
/// picking the global minimum from slightly stale counts while staying close to
/// least-loaded.
#[derive(Debug, Default, Clone, Copy)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(
        &self,
        _role: WorkerRole,
        candidates: &[Arc<Worker>],
        _request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        let n = candidates.len();
        if n <= 1 {
            return candidates.first().cloned();
        }
        let mut rng = rand::rng();
        let a = rng.random_range(0..n);
        // Draw from the other n - 1 indices so the two are always distinct.
        let mut b = rng.random_range(0..n - 1);
        if b >= a {
            b += 1;
        }
        let (a, b) = (&candidates[a], &candidates[b]);
        let rank = |w: &Worker| (w.load(), w.in_flight());
        Some(if rank(b) < rank(a) { b } else { a }.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{chat, index_of, load, pick, workers};

    #[test]
    fn of_two_always_takes_the_less_loaded() {
        let ws = workers(WorkerRole::Prefill, &[1, 2]);
        let _busy = load(&ws[0], 3);
        let request = chat("hi");
        for _ in 0..200 {
            assert_eq!(
                pick(&PowerOfTwo, WorkerRole::Prefill, &ws, &request),
                "http://127.0.0.1:2"
            );
        }
    }

    #[test]
    fn never_takes_the_most_loaded_and_favours_the_least() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3]);
        let _mid = load(&ws[1], 5);
        let _high = load(&ws[2], 10);
        let request = chat("hi");
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            let base = pick(&PowerOfTwo, WorkerRole::Decode, &ws, &request);
            counts[index_of(&ws, &base)] += 1;
        }
        // The idle worker is in 2 of the 3 possible pairs, the middle one wins the third;
        // the busiest never wins a pair.
        assert_eq!(counts[2], 0, "{counts:?}");
        assert!((19_000..=21_000).contains(&counts[0]), "{counts:?}");
        assert!((9_000..=11_000).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn equal_load_spreads_evenly() {
        let ws = workers(WorkerRole::Decode, &[1, 2, 3]);
        let request = chat("hi");
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            let base = pick(&PowerOfTwo, WorkerRole::Decode, &ws, &request);
            counts[index_of(&ws, &base)] += 1;
        }
        for c in counts {
            assert!((9_300..=10_700).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn handles_one_and_no_candidates() {
        let ws = workers(WorkerRole::Decode, &[7]);
        assert_eq!(
            pick(&PowerOfTwo, WorkerRole::Decode, &ws, &chat("hi")),
            "http://127.0.0.1:7"
        );
        let headers = http::HeaderMap::new();
        let route = RouteRequest::bodyless(crate::endpoint::Endpoint::Chat, &headers);
        assert!(PowerOfTwo.select(WorkerRole::Decode, &[], &route).is_none());
    }
}
