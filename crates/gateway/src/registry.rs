//! Static worker pools per role, with round-robin cursors and in-flight counts.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use reqwest::Url;

use crate::metrics::Metrics;

/// What a worker does in a request's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the prompt's KV and hands it to a decode worker.
    Prefill,
    /// Pulls a prefilled KV and generates.
    Decode,
    /// Does both (no handoff).
    Aggregated,
}

impl Role {
    /// The role's name in logs, metrics and `/health`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Aggregated => "worker",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The OpenAI endpoint a generation request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Endpoint {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }
}

/// One upstream worker.
#[derive(Debug)]
pub struct Worker {
    /// The role it was configured for.
    pub role: Role,
    /// Its base URL as configured (for logs and metrics labels).
    pub base: String,
    chat_url: Url,
    completions_url: Url,
    models_url: Url,
    /// Open requests, exported as a metric and read for `/health`.
    in_flight: Gauge,
}

impl Worker {
    fn new(role: Role, base: &Url, metrics: &Metrics) -> Self {
        let root = base.as_str().trim_end_matches('/').to_string();
        let join = |path: &str| {
            Url::parse(&format!("{root}{path}")).expect("a valid base URL plus a path is valid")
        };
        Self {
            role,
            chat_url: join(Endpoint::Chat.path()),
            completions_url: join(Endpoint::Completions.path()),
            models_url: join("/v1/models"),
            in_flight: metrics.worker_in_flight(role.as_str(), &root),
            base: root,
        }
    }

    /// The full URL of `endpoint` on this worker.
    pub fn url(&self, endpoint: Endpoint) -> &Url {
        match endpoint {
            Endpoint::Chat => &self.chat_url,
            Endpoint::Completions => &self.completions_url,
        }
    }

    /// The worker's `/v1/models` URL.
    pub fn models_url(&self) -> &Url {
        &self.models_url
    }

    /// Requests this gateway has open on the worker.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }
}

/// Counts one open request on a worker until dropped (so cancellation and errors count too).
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
}

impl InFlight {
    /// Marks a request as open on `worker`.
    pub fn start(worker: Arc<Worker>) -> Self {
        worker.in_flight.inc();
        Self { worker }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.dec();
    }
}

/// A fixed list of workers of one role with a shared round-robin cursor.
#[derive(Debug, Default)]
pub struct Pool {
    workers: Vec<Arc<Worker>>,
    cursor: AtomicUsize,
}

impl Pool {
    fn new(role: Role, urls: &[Url], metrics: &Metrics) -> Self {
        Self {
            workers: urls
                .iter()
                .map(|u| Arc::new(Worker::new(role, u, metrics)))
                .collect(),
            cursor: AtomicUsize::new(0),
        }
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the pool has no worker.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The workers in configuration order.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    /// The next worker in round-robin order.
    pub fn next(&self) -> Option<Arc<Worker>> {
        self.next_excluding(&[])
    }

    /// The next worker in round-robin order that is not in `tried`, if any is left.
    pub fn next_excluding(&self, tried: &[Arc<Worker>]) -> Option<Arc<Worker>> {
        let n = self.workers.len();
        if n == 0 {
            return None;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.workers[(start + i) % n])
            .find(|w| !tried.iter().any(|t| Arc::ptr_eq(t, w)))
            .cloned()
    }
}

/// All worker pools, by role.
#[derive(Debug, Default)]
pub struct Registry {
    /// Prefill workers.
    pub prefill: Pool,
    /// Decode workers.
    pub decode: Pool,
    /// Aggregated workers.
    pub aggregated: Pool,
}

/// How requests are served with the configured pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Prefill on one pool, decode on the other.
    Disaggregated,
    /// One worker does both.
    Aggregated,
    /// Nothing can serve a request.
    Unavailable,
}

impl Registry {
    /// Pools from configured base URLs.
    pub fn new(prefill: &[Url], decode: &[Url], aggregated: &[Url], metrics: &Metrics) -> Self {
        Self {
            prefill: Pool::new(Role::Prefill, prefill, metrics),
            decode: Pool::new(Role::Decode, decode, metrics),
            aggregated: Pool::new(Role::Aggregated, aggregated, metrics),
        }
    }

    /// P/D when both halves exist, else aggregated workers when there are any.
    pub fn mode(&self) -> Mode {
        if !self.prefill.is_empty() && !self.decode.is_empty() {
            Mode::Disaggregated
        } else if !self.aggregated.is_empty() {
            Mode::Aggregated
        } else {
            Mode::Unavailable
        }
    }

    /// The roles a request would need but that have no worker.
    pub fn missing_roles(&self) -> Vec<Role> {
        let mut missing = Vec::new();
        if self.prefill.is_empty() {
            missing.push(Role::Prefill);
        }
        if self.decode.is_empty() {
            missing.push(Role::Decode);
        }
        if self.aggregated.is_empty() {
            missing.push(Role::Aggregated);
        }
        missing
    }

    /// The worker that answers `/v1/models`: a decode worker, else an aggregated one,
    /// else a prefill one (all serve the same model).
    pub fn models_worker(&self) -> Option<Arc<Worker>> {
        self.decode
            .next()
            .or_else(|| self.aggregated.next())
            .or_else(|| self.prefill.next())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(ports: &[u16]) -> Vec<Url> {
        ports
            .iter()
            .map(|p| Url::parse(&format!("http://127.0.0.1:{p}")).unwrap())
            .collect()
    }

    #[test]
    fn round_robin_and_exclusion() {
        let m = Metrics::default();
        let pool = Pool::new(Role::Decode, &urls(&[1, 2, 3]), &m);
        let picks: Vec<_> = (0..4).map(|_| pool.next().unwrap().base.clone()).collect();
        assert_eq!(
            picks,
            [
                "http://127.0.0.1:1",
                "http://127.0.0.1:2",
                "http://127.0.0.1:3",
                "http://127.0.0.1:1"
            ]
        );
        let first = pool.workers()[0].clone();
        for _ in 0..5 {
            assert!(!Arc::ptr_eq(
                &pool.next_excluding(std::slice::from_ref(&first)).unwrap(),
                &first
            ));
        }
        let single = Pool::new(Role::Decode, &urls(&[1]), &m);
        let only = single.next().unwrap();
        assert!(single.next_excluding(&[only]).is_none());
    }

    #[test]
    fn endpoint_urls_and_mode() {
        let m = Metrics::default();
        let w = Worker::new(
            Role::Prefill,
            &Url::parse("http://h:1/prefix/").unwrap(),
            &m,
        );
        assert_eq!(
            w.url(Endpoint::Chat).as_str(),
            "http://h:1/prefix/v1/chat/completions"
        );
        assert_eq!(w.models_url().as_str(), "http://h:1/prefix/v1/models");
        assert_eq!(
            Registry::new(&urls(&[1]), &urls(&[2]), &[], &m).mode(),
            Mode::Disaggregated
        );
        assert_eq!(
            Registry::new(&urls(&[1]), &[], &urls(&[3]), &m).mode(),
            Mode::Aggregated
        );
        assert_eq!(
            Registry::new(&urls(&[1]), &[], &[], &m).mode(),
            Mode::Unavailable
        );
    }
}
