//! Overload control: at most `--max-concurrent-requests` generation requests run at once;
//! the others wait in a queue of at most `--queue-size`, ordered by priority (lower value
//! first, as vLLM's `priority`), then by deadline (arrival + the request's TTFT objective,
//! `x-slo-ttft-ms` or `--slo-ttft-ms`; without one, arrival + `--queue-timeout-secs`),
//! then by arrival, for at most `--queue-timeout-secs`.
//! A full queue is a 429 and a wait that ran out a 408, both with `Retry-After`; a client
//! that leaves while queued frees its place at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode};
use pdserve_protocol::ApiError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry as MetricsRegistry;
use tokio::sync::oneshot;

/// The header that sets a request's priority when its body has no `priority`.
pub const PRIORITY_HEADER: &str = "x-pdserve-priority";

/// A request's priority: its body's `priority` (`field`, as the client wrote it: vLLM's
/// and SGLang's field, passed on to the workers), else the [`PRIORITY_HEADER`], else 0.
/// Lower goes first.
#[allow(clippy::result_large_err)]
pub fn priority(field: Option<&str>, headers: &HeaderMap) -> Result<i64, ApiError> {
    let parse = |text: &str, param: &str| {
        text.trim().parse::<i64>().map_err(|_| {
            ApiError::bad_request(format!("{param} must be an integer, got {text}"))
                .with_param(param)
        })
    };
    if let Some(text) = field {
        return parse(text, "priority");
    }
    match headers.get(PRIORITY_HEADER) {
        None => Ok(0),
        Some(value) => parse(value.to_str().unwrap_or_default(), PRIORITY_HEADER),
    }
}

/// Admits a request at `priority` (see [`priority`]) or answers why not: a full queue
/// (429), a wait that ran out (408), both with `Retry-After`.
pub async fn admit(
    admission: &Arc<Admission>,
    priority: i64,
    ttft: Option<Duration>,
) -> Result<Permit, Response> {
    if admission.max_running == 0 {
        return Ok(Permit { admission: None });
    }
    let rejection = match admission.admit_by(priority, ttft).await {
        Ok(permit) => return Ok(permit),
        Err(rejection) => rejection,
    };
    let error = match rejection {
        Rejection::QueueFull => ApiError::too_many_requests(format!(
            "the gateway is at --max-concurrent-requests ({}) with a full queue ({}); retry later",
            admission.max_running, admission.max_waiting
        )),
        Rejection::QueueTimeout => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "queue_timeout",
            format!(
                "the request waited in the queue for {} s without a place; retry later",
                admission.timeout.as_secs_f64()
            ),
        ),
    };
    let mut response = error.into_response();
    response.headers_mut().insert(
        http::header::RETRY_AFTER,
        HeaderValue::from(admission.retry_after()),
    );
    Err(response)
}

/// `response` with `permit` held until its body is sent (or the client leaves): a
/// streamed answer keeps its place while it streams.
pub fn hold_until_sent(response: Response, permit: Permit) -> Response {
    if permit.admission.is_none() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &permit;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(stream))
}

/// Labels of the rejection counter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

/// Queue depth, wait and rejections.
#[derive(Debug)]
pub struct AdmissionMetrics {
    depth: Gauge,
    wait_seconds: Histogram,
    rejected: Family<ReasonLabels, Counter>,
}

impl AdmissionMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut MetricsRegistry) -> Self {
        let metrics = Self {
            depth: Gauge::default(),
            wait_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 18)),
            rejected: Family::default(),
        };
        registry.register(
            "queue_depth",
            "Requests waiting for a place (--max-concurrent-requests)",
            metrics.depth.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "How long admitted requests waited in the queue",
            metrics.wait_seconds.clone(),
        );
        registry.register(
            "rejected_requests",
            "Requests refused by overload control: queue_full (429), queue_timeout (408), \
             slo_shed (429: sheddable, and no worker predicted to meet its objectives)",
            metrics.rejected.clone(),
        );
        metrics
    }

    fn set_queue_depth(&self, depth: usize) {
        self.depth.set(depth as i64);
    }

    fn observe_queue_wait(&self, waited: Duration) {
        self.wait_seconds.observe(waited.as_secs_f64());
    }

    /// Counts a sheddable request refused because no worker was predicted to meet its
    /// objectives.
    pub fn record_shed(&self) {
        self.record_rejection("slo_shed");
    }

    fn record_rejection(&self, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The queue was full (429).
    QueueFull,
    /// The request waited `--queue-timeout-secs` without a place (408).
    QueueTimeout,
}

impl Rejection {
    /// The `reason` label of the rejection counter.
    pub fn reason(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::QueueTimeout => "queue_timeout",
        }
    }
}

/// A waiting request's place: priority, then deadline (microseconds after the admission
/// began), then arrival.
type Place = (i64, u64, u64);

#[derive(Default)]
struct Queue {
    running: usize,
    next_arrival: u64,
    waiting: BTreeMap<Place, oneshot::Sender<Permit>>,
}

/// The admission limits and the queue.
pub struct Admission {
    max_running: usize,
    max_waiting: usize,
    timeout: Duration,
    queue: Mutex<Queue>,
    metrics: Arc<AdmissionMetrics>,
    /// What deadlines are counted from.
    epoch: Instant,
}

/// A place among the running requests; dropping it hands the place to the first waiter.
pub struct Permit {
    admission: Option<Arc<Admission>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(admission) = self.admission.take() {
            admission.release();
        }
    }
}

/// Takes a waiter's place out of the queue if it leaves (timeout, client gone) before
/// it was admitted.
struct Waiting<'a> {
    admission: &'a Arc<Admission>,
    place: Option<Place>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(place) = self.place.take() {
            let mut queue = self.admission.lock();
            queue.waiting.remove(&place);
            self.admission.metrics.set_queue_depth(queue.waiting.len());
        }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = self.lock();
        f.debug_struct("Admission")
            .field("max_running", &self.max_running)
            .field("max_waiting", &self.max_waiting)
            .field("running", &queue.running)
            .field("waiting", &queue.waiting.len())
            .finish()
    }
}

impl Admission {
    /// Limits of `max_running` running and `max_waiting` queued requests, each waiting
    /// at most `timeout`; `max_running` 0 admits everything at once.
    pub fn new(
        max_running: usize,
        max_waiting: usize,
        timeout: Duration,
        metrics: Arc<AdmissionMetrics>,
    ) -> Arc<Self> {
        Arc::new(Self {
            max_running,
            max_waiting,
            timeout,
            queue: Mutex::default(),
            metrics,
            epoch: Instant::now(),
        })
    }

    /// How long a rejected client is told to wait (`Retry-After`, whole seconds).
    pub fn retry_after(&self) -> u64 {
        self.timeout.as_secs().clamp(1, 60)
    }

    /// Counts a sheddable request refused on its prediction (`rejected_requests`,
    /// `reason="slo_shed"`).
    pub fn record_shed(&self) {
        self.metrics.record_shed();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A running place for a request of `priority`: at once, after waiting its turn, or
    /// refused.
    pub async fn admit(self: &Arc<Self>, priority: i64) -> Result<Permit, Rejection> {
        self.admit_by(priority, None).await
    }

    /// [`Self::admit`] for a request whose first token is due within `ttft`: among
    /// waiters of one priority, the earliest deadline goes first.
    pub async fn admit_by(
        self: &Arc<Self>,
        priority: i64,
        ttft: Option<Duration>,
    ) -> Result<Permit, Rejection> {
        let permit = || Permit {
            admission: Some(self.clone()),
        };
        if self.max_running == 0 {
            return Ok(Permit { admission: None });
        }
        let started = Instant::now();
        let (place, admitted) = {
            let mut queue = self.lock();
            if queue.running < self.max_running && queue.waiting.is_empty() {
                queue.running += 1;
                return Ok(permit());
            }
            if queue.waiting.len() >= self.max_waiting {
                drop(queue);
                self.metrics.record_rejection(Rejection::QueueFull.reason());
                return Err(Rejection::QueueFull);
            }
            let due = started + ttft.unwrap_or(self.timeout);
            let deadline = due.saturating_duration_since(self.epoch).as_micros() as u64;
            let place = (priority, deadline, queue.next_arrival);
            queue.next_arrival += 1;
            let (tx, rx) = oneshot::channel();
            queue.waiting.insert(place, tx);
            self.metrics.set_queue_depth(queue.waiting.len());
            (place, rx)
        };
        let mut waiting = Waiting {
            admission: self,
            place: Some(place),
        };
        match tokio::time::timeout(self.timeout, admitted).await {
            Ok(Ok(permit)) => {
                // `release` took the place out of the queue when it handed the permit.
                waiting.place = None;
                self.metrics.observe_queue_wait(started.elapsed());
                Ok(permit)
            }
            _ => {
                drop(waiting);
                self.metrics
                    .record_rejection(Rejection::QueueTimeout.reason());
                Err(Rejection::QueueTimeout)
            }
        }
    }

    /// A running request ended: its place goes to the first waiter still there.
    fn release(self: &Arc<Self>) {
        let mut queue = self.lock();
        while let Some((_, tx)) = queue.waiting.pop_first() {
            let handed = Permit {
                admission: Some(self.clone()),
            };
            match tx.send(handed) {
                Ok(()) => {
                    self.metrics.set_queue_depth(queue.waiting.len());
                    return;
                }
                // Its waiter is gone; dropping the returned permit must not recurse into
                // this lock, so it is forgotten (the place stays counted as running and
                // goes to the next waiter).
                Err(mut permit) => permit.admission = None,
            }
        }
        queue.running -= 1;
        self.metrics.set_queue_depth(queue.waiting.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(running: usize, waiting: usize, timeout_ms: u64) -> Arc<Admission> {
        Admission::new(
            running,
            waiting,
            Duration::from_millis(timeout_ms),
            Arc::new(AdmissionMetrics::register(&mut MetricsRegistry::default())),
        )
    }

    #[tokio::test]
    async fn waiters_go_by_priority_then_arrival() {
        let a = admission(1, 8, 5_000);
        let running = a.admit(0).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, priority) in [("low", 5), ("high-1", -1), ("mid", 0), ("high-2", -1)] {
            let (a, order) = (a.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let permit = a.admit(priority).await.unwrap();
                order.lock().unwrap().push(name);
                drop(permit);
            }));
            // Arrival order is the spawn order.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(running);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["high-1", "high-2", "mid", "low"]);
        assert_eq!(a.lock().running, 0);
    }

    #[tokio::test]
    async fn within_a_priority_the_earliest_deadline_goes_first() {
        let a = admission(1, 8, 5_000);
        let running = a.admit(0).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // (name, priority, TTFT objective in ms): arrival order is the list's.
        for (name, priority, ttft) in [
            ("relaxed", 0, Some(4_000)),
            ("none", 0, None),
            ("urgent", 0, Some(100)),
            ("later-priority", 1, Some(10)),
            ("soon", 0, Some(1_000)),
        ] {
            let (a, order) = (a.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let ttft = ttft.map(Duration::from_millis);
                let permit = a.admit_by(priority, ttft).await.unwrap();
                order.lock().unwrap().push(name);
                drop(permit);
            }));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(running);
        for task in tasks {
            task.await.unwrap();
        }
        // Without an objective, the queue timeout (5 s) is the deadline.
        assert_eq!(
            *order.lock().unwrap(),
            ["urgent", "soon", "relaxed", "none", "later-priority"]
        );
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_a_long_wait_times_out() {
        let a = admission(1, 1, 100);
        let _running = a.admit(0).await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.admit(0).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(a.admit(0).await.err(), Some(Rejection::QueueFull));
        assert_eq!(waiter.await.unwrap(), Err(Rejection::QueueTimeout));
        assert!(
            a.lock().waiting.is_empty(),
            "the timed-out waiter left the queue"
        );
    }

    #[tokio::test]
    async fn a_client_that_leaves_frees_its_place() {
        let a = admission(1, 1, 5_000);
        let running = a.admit(0).await.unwrap();
        let gone = tokio::spawn({
            let a = a.clone();
            async move { a.admit(0).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        assert!(a.lock().waiting.is_empty());
        // Its place is free for the next one, which then runs once the first ends.
        let next = tokio::spawn({
            let a = a.clone();
            async move { a.admit(0).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(running);
        assert_eq!(next.await.unwrap(), Ok(()));
        assert_eq!(a.lock().running, 0);
    }

    #[tokio::test]
    async fn no_limit_admits_everything() {
        let a = admission(0, 0, 10);
        let permits: Vec<_> = futures::future::join_all((0..100).map(|_| a.admit(0))).await;
        assert!(permits.iter().all(Result::is_ok));
    }
}
