//! The prefill workers an orchestrator sends prefill legs to: which are warm, where
//! their KV services are, and which one a request goes to.
//!
//! Requests go to warm workers only (all workers while none is warm, so a request is
//! tried rather than refused). Without a session key they go round-robin; with one, by
//! rendezvous (highest-random-weight) hashing of key and worker URL, so a session stays
//! on its worker while that worker is warm and only the sessions of a worker that goes
//! cold move. The hash is a fixed FNV-1a with a final mix, so the mapping is the same
//! after a restart and on every orchestrator with the same `--prefill` list.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::kv::pull::KvPeer;
use crate::metrics::Metrics;

/// One prefill worker of the pool.
#[derive(Debug)]
pub struct PrefillWorker {
    /// Base URL (`http://host:port`).
    pub url: String,
    warm: AtomicBool,
    /// Its KV service, as its last answer named it.
    kv_peer: Mutex<Option<KvPeer>>,
    /// Wakes the worker's supervisor when a request found the worker gone.
    pub(super) went_cold: Notify,
    /// Cleared when the worker published under an id of its own although asked for
    /// ours (it predates `publish_request_id`): concurrent handoff cannot read early.
    awaited_reads: AtomicBool,
}

impl PrefillWorker {
    fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            warm: AtomicBool::new(false),
            kv_peer: Mutex::new(None),
            went_cold: Notify::new(),
            awaited_reads: AtomicBool::new(true),
        }
    }

    /// Whether a KV read may start before the worker answers (concurrent handoff).
    pub fn supports_awaited_reads(&self) -> bool {
        self.awaited_reads.load(Ordering::Relaxed)
    }

    /// Records that the worker ignores `publish_request_id`.
    pub fn ignores_publish_request_id(&self) {
        if self.awaited_reads.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                prefill = %self.url,
                "the prefill worker ignores publish_request_id; using sequential handoff with it"
            );
        }
    }

    /// Whether a pre-warm request went through this worker and it has not failed since.
    pub fn is_warm(&self) -> bool {
        self.warm.load(Ordering::SeqCst)
    }

    /// Where its KV service is, once it has answered a prefill.
    pub fn kv_peer(&self) -> Option<KvPeer> {
        self.kv_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records where its KV service is (a restarted worker may have a new one).
    pub fn set_kv_peer(&self, peer: KvPeer) {
        *self.kv_peer.lock().unwrap_or_else(|e| e.into_inner()) = Some(peer);
    }
}

/// The prefill workers of one orchestrator.
#[derive(Debug)]
pub struct PrefillPool {
    workers: Vec<Arc<PrefillWorker>>,
    cursor: AtomicUsize,
    warm: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl PrefillPool {
    /// A pool over `urls`, none of them warm yet.
    pub fn new(urls: &[String], metrics: Arc<Metrics>) -> Self {
        Self {
            workers: urls
                .iter()
                .map(|u| Arc::new(PrefillWorker::new(u)))
                .collect(),
            cursor: AtomicUsize::new(0),
            warm: AtomicUsize::new(0),
            metrics,
        }
    }

    /// Every worker, warm or not.
    pub fn workers(&self) -> &[Arc<PrefillWorker>] {
        &self.workers
    }

    /// How many workers are warm; `/health` is 503 while this is 0.
    pub fn warm_count(&self) -> usize {
        self.warm.load(Ordering::SeqCst)
    }

    /// Marks `worker` warm (a pre-warm request went through it).
    pub fn mark_warm(&self, worker: &PrefillWorker) {
        if !worker.warm.swap(true, Ordering::SeqCst) {
            let n = self.warm.fetch_add(1, Ordering::SeqCst) + 1;
            self.metrics.orchestrator.warm_prefill_workers.set(n as i64);
        }
    }

    /// Marks `worker` cold (unreachable or unhealthy) and wakes its supervisor.
    pub fn mark_cold(&self, worker: &PrefillWorker) {
        if worker.warm.swap(false, Ordering::SeqCst) {
            let n = self.warm.fetch_sub(1, Ordering::SeqCst) - 1;
            self.metrics.orchestrator.warm_prefill_workers.set(n as i64);
        }
        worker.went_cold.notify_one();
    }

    /// The worker for a request with `session` (or none): see the module docs.
    pub fn choose(&self, session: Option<&str>) -> Arc<PrefillWorker> {
        let warm: Vec<&Arc<PrefillWorker>> = self.workers.iter().filter(|w| w.is_warm()).collect();
        let candidates: Vec<&Arc<PrefillWorker>> = if warm.is_empty() {
            self.workers.iter().collect()
        } else {
            warm
        };
        let chosen = match session {
            Some(key) => owner(key, &candidates),
            None => {
                let turn = self.cursor.fetch_add(1, Ordering::Relaxed);
                candidates[turn % candidates.len()]
            }
        };
        chosen.clone()
    }
}

/// The candidate that owns session `key` (`candidates` is not empty).
fn owner<'w>(key: &str, candidates: &[&'w Arc<PrefillWorker>]) -> &'w Arc<PrefillWorker> {
    pdserve_protocol::session::rendezvous_owner(key, candidates, |w| w.url.as_str())
        .copied()
        .expect("candidates is not empty")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> PrefillPool {
        let urls: Vec<String> = (0..n).map(|i| format!("http://p{i}:1")).collect();
        PrefillPool::new(&urls, Arc::new(Metrics::new()))
    }

    #[test]
    fn round_robin_over_warm_workers_or_all_when_none_is_warm() {
        let pool = pool(3);
        let urls: Vec<String> = (0..6).map(|_| pool.choose(None).url.clone()).collect();
        assert_eq!(urls[..3], urls[3..]);
        assert_eq!(
            urls[..3]
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            3
        );
        let workers = pool.workers().to_vec();
        pool.mark_warm(&workers[1]);
        pool.mark_warm(&workers[1]);
        assert_eq!(pool.warm_count(), 1);
        for _ in 0..4 {
            assert_eq!(pool.choose(None).url, "http://p1:1");
        }
        pool.mark_cold(&workers[1]);
        pool.mark_cold(&workers[1]);
        assert_eq!(pool.warm_count(), 0);
    }

    #[test]
    fn a_session_stays_on_its_worker_and_only_a_cold_workers_sessions_move() {
        let pool = pool(4);
        for w in pool.workers() {
            pool.mark_warm(w);
        }
        let sessions: Vec<String> = (0..64).map(|i| format!("session-{i}")).collect();
        let before: Vec<String> = sessions
            .iter()
            .map(|s| pool.choose(Some(s)).url.clone())
            .collect();
        for (s, url) in sessions.iter().zip(&before) {
            assert_eq!(&pool.choose(Some(s)).url, url, "{s} moved");
        }
        let used: std::collections::HashSet<_> = before.iter().collect();
        assert_eq!(used.len(), 4, "64 sessions use every worker");
        let gone = pool.workers()[2].clone();
        pool.mark_cold(&gone);
        for (s, url) in sessions.iter().zip(&before) {
            let now = pool.choose(Some(s)).url.clone();
            if *url == gone.url {
                assert_ne!(now, gone.url);
            } else {
                assert_eq!(&now, url, "{s} moved although its worker stayed");
            }
        }
    }
}
