//! The worker's status page: `GET /dashboard` (one self-contained HTML page, no external
//! URL) and `GET /dashboard/data` (the JSON it polls once a second): role, model,
//! sequences running and waiting, KV blocks, prefix-cache hits, prompt and generated
//! tokens per second, and the last generation requests. Open under `--api-key`, as
//! `/metrics` is.
//!
//! The gauges and counters are the engine's own metrics, sampled once a second by a task
//! (and when the page asks; at most one sample a second is kept, the last 300); each
//! finished generation request is one short-locked push into a ring of the last 50.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::StreamExt;
use http::{header, Method};
use pdserve_http_server::dashboard::DashboardPage;
use serde::Serialize;

use super::http_layers::REQUEST_ID_HEADER;
use super::AppState;
use crate::metrics::Metrics;

/// The page, embedded in the binary (its script starts with the one both pages share).
pub static PAGE: DashboardPage = DashboardPage::new(include_str!("dashboard.html"));

/// Samples kept (one a second at most: five minutes of charts).
const SAMPLES: usize = 300;
/// Finished requests kept.
const RECENT_REQUESTS: usize = 50;

/// The worker's dashboard memory, shared by the recording layer and the data route.
#[derive(Debug)]
pub struct WorkerHistory {
    metrics: Arc<Metrics>,
    samples: Mutex<VecDeque<Counters>>,
    requests: Mutex<VecDeque<RequestRow>>,
}

impl WorkerHistory {
    /// A fresh history of the engine's `metrics`, to hand to [`record`] and [`data`] as
    /// an extension. Inside a tokio runtime a task samples the metrics once a second
    /// (sampling when requests finish would always see their sequences gone) until the
    /// history is dropped with the router.
    pub fn shared(metrics: Arc<Metrics>) -> Arc<Self> {
        let history = Arc::new(Self {
            metrics,
            samples: Mutex::default(),
            requests: Mutex::default(),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&history);
            runtime.spawn(async move {
                let mut ticks = tokio::time::interval(Duration::from_secs(1));
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    match weak.upgrade() {
                        Some(history) => history.sample(),
                        None => return,
                    };
                }
            });
        }
        history
    }

    /// Reads the engine's counters into a sample unless the last one is under a second
    /// old (called each second, and by each poll so the page shows the present).
    fn sample(&self) -> Counters {
        let m = &self.metrics;
        let now = Counters {
            at: Instant::now(),
            t_ms: unix_ms(SystemTime::now()),
            prompt_tokens: m.prompt_tokens.get(),
            generation_tokens: m.generation_tokens.get(),
            running: m.running.get(),
            waiting: m.waiting.get(),
            kv_used: m.kv_blocks_used.get(),
            kv_free: m.kv_blocks_free.get(),
        };
        let mut ring = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let due = ring
            .back()
            .is_none_or(|last| now.at.duration_since(last.at) >= Duration::from_millis(900));
        if due {
            if ring.len() == SAMPLES {
                ring.pop_front();
            }
            ring.push_back(now);
        }
        now
    }

    fn push_request(&self, row: RequestRow) {
        let mut ring = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT_REQUESTS {
            ring.pop_front();
        }
        ring.push_back(row);
    }
}

/// The engine's counters at one moment.
#[derive(Debug, Clone, Copy)]
struct Counters {
    at: Instant,
    t_ms: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    running: i64,
    waiting: i64,
    kv_used: i64,
    kv_free: i64,
}

/// The whole answer of the worker's `/dashboard/data`.
#[derive(Debug, Serialize)]
pub struct WorkerDashboard {
    /// The worker itself and its gauges now.
    pub worker: WorkerNow,
    /// About one per second, oldest first (at most 300).
    pub samples: Vec<WorkerSample>,
    /// The last finished generation requests, newest first (at most 50).
    pub requests: Vec<RequestRow>,
}

/// The worker's facts and gauges now.
#[derive(Debug, Serialize)]
pub struct WorkerNow {
    /// pdserve's version.
    pub version: &'static str,
    /// Unix milliseconds when this answer was made.
    pub now_ms: u64,
    /// `prefill`, `decode` or `prefill_decode`.
    pub role: String,
    /// Whether it orchestrates its own prefill legs (`--role decode --prefill URL…`).
    pub orchestrator: bool,
    /// The served model name.
    pub model: String,
    /// Sequences in the running batch.
    pub running: i64,
    /// Sequences waiting for admission.
    pub waiting: i64,
    /// KV blocks referenced by a sequence or a pin.
    pub kv_blocks_used: i64,
    /// KV blocks that can be allocated (reclaimable cached ones included).
    pub kv_blocks_free: i64,
    /// KV blocks findable in the prefix cache.
    pub kv_blocks_cached: i64,
    /// KV blocks held for a KV transfer.
    pub kv_blocks_pinned: i64,
    /// Prompt tokens found in the prefix cache over those looked up, since start.
    pub prefix_cache_hit_ratio: Option<f64>,
    /// Prompt tokens of admitted requests, since start.
    pub prompt_tokens_total: u64,
    /// Generated tokens, since start.
    pub generation_tokens_total: u64,
    /// KV blocks sent to peers, since start.
    pub kv_blocks_sent_total: u64,
    /// KV blocks received from peers, since start.
    pub kv_blocks_received_total: u64,
}

/// One sample as the charts draw it.
#[derive(Debug, Serialize)]
pub struct WorkerSample {
    /// Unix milliseconds.
    pub t_ms: u64,
    /// Prompt tokens admitted per second since the previous sample.
    pub prompt_tokens_per_s: Option<f64>,
    /// Tokens generated per second since the previous sample.
    pub generation_tokens_per_s: Option<f64>,
    /// Sequences running.
    pub running: i64,
    /// Sequences waiting.
    pub waiting: i64,
    /// Share of KV blocks in use, 0-1.
    pub kv_usage: f64,
}

/// One finished generation request.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRow {
    /// Unix milliseconds when it finished.
    pub finished_ms: u64,
    /// Its `X-Request-Id`.
    pub request_id: String,
    /// The route (`/v1/chat/completions`, `/generate`, ...).
    pub path: String,
    /// The HTTP status.
    pub status: u16,
    /// Whether the answer was an event stream.
    pub stream: bool,
    /// `ok`, `error` (status ≥ 400) or `client_left` (the stream was dropped unfinished).
    pub outcome: &'static str,
    /// Arrival to the response head, ms (a stream's first event is ready by then).
    pub head_ms: f64,
    /// Arrival to the end of the answer, ms.
    pub duration_ms: f64,
}

/// `GET /dashboard`: the page.
pub async fn page() -> Response {
    PAGE.response()
}

/// `GET /dashboard/data`.
pub async fn data(
    State(app): State<Arc<AppState>>,
    Extension(history): Extension<Arc<WorkerHistory>>,
) -> Response {
    let m = &app.serving.metrics;
    let now = history.sample();
    let samples = {
        let ring = history.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(ring.len());
        let mut previous: Option<&Counters> = None;
        for c in ring.iter() {
            let rate = |f: fn(&Counters) -> u64| {
                let p = previous?;
                let secs = c.at.duration_since(p.at).as_secs_f64();
                (secs > 0.0).then(|| f(c).saturating_sub(f(p)) as f64 / secs)
            };
            let blocks = (c.kv_used + c.kv_free).max(1) as f64;
            out.push(WorkerSample {
                t_ms: c.t_ms,
                prompt_tokens_per_s: rate(|c| c.prompt_tokens),
                generation_tokens_per_s: rate(|c| c.generation_tokens),
                running: c.running,
                waiting: c.waiting,
                kv_usage: c.kv_used.max(0) as f64 / blocks,
            });
            previous = Some(c);
        }
        out
    };
    let queries = m.prefix_cache_queries.get();
    let requests = {
        let ring = history.requests.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().cloned().collect()
    };
    let answer = WorkerDashboard {
        worker: WorkerNow {
            version: env!("CARGO_PKG_VERSION"),
            now_ms: now.t_ms,
            role: app.bootstrap.role.to_string(),
            orchestrator: app.orchestrator.is_some(),
            model: app.serving.limits.served_model_name.clone(),
            running: now.running,
            waiting: now.waiting,
            kv_blocks_used: now.kv_used,
            kv_blocks_free: now.kv_free,
            kv_blocks_cached: m.kv_blocks_cached.get(),
            kv_blocks_pinned: m.kv_blocks_pinned.get(),
            prefix_cache_hit_ratio: (queries > 0)
                .then(|| m.prefix_cache_hits.get() as f64 / queries as f64),
            prompt_tokens_total: now.prompt_tokens,
            generation_tokens_total: now.generation_tokens,
            kv_blocks_sent_total: m.kv.blocks_sent.get(),
            kv_blocks_received_total: m.kv.blocks_received.get(),
        },
        samples,
        requests,
    };
    ([(header::CACHE_CONTROL, "no-store")], Json(answer)).into_response()
}

/// Whether a request is a generation the page lists.
fn is_generation(method: &Method, path: &str) -> bool {
    method == Method::POST
        && matches!(
            path,
            "/v1/chat/completions" | "/v1/completions" | "/v1/responses" | "/generate"
        )
}

/// Middleware: files each finished generation request in the history (a body when its
/// head is ready, a stream when it ends or is dropped).
pub async fn record(
    Extension(history): Extension<Arc<WorkerHistory>>,
    request: Request,
    next: Next,
) -> Response {
    if !is_generation(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    let started = Instant::now();
    let path = request.uri().path().to_owned();
    let request_id = request
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let response = next.run(request).await;
    let status = response.status().as_u16();
    let stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let mut pending = Pending {
        history,
        row: Some(RequestRow {
            finished_ms: 0,
            request_id,
            path,
            status,
            stream,
            outcome: if status < 400 { "ok" } else { "error" },
            head_ms: ms(started.elapsed()),
            duration_ms: 0.0,
        }),
        started,
    };
    if !stream {
        pending.file(None);
        return response;
    }
    // A stream is filed when its body ends, or as left when it is dropped before.
    let (parts, body) = response.into_parts();
    let body = futures::stream::unfold(
        (body.into_data_stream(), pending),
        |(mut body, mut pending)| async move {
            match body.next().await {
                Some(chunk) => Some((chunk, (body, pending))),
                None => {
                    pending.file(None);
                    None
                }
            }
        },
    );
    Response::from_parts(parts, Body::from_stream(body))
}

/// A request not yet filed.
struct Pending {
    history: Arc<WorkerHistory>,
    row: Option<RequestRow>,
    started: Instant,
}

impl Pending {
    fn file(&mut self, outcome: Option<&'static str>) {
        if let Some(mut row) = self.row.take() {
            row.finished_ms = unix_ms(SystemTime::now());
            row.duration_ms = ms(self.started.elapsed());
            if let Some(outcome) = outcome {
                row.outcome = outcome;
            }
            self.history.push_request(row);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.file(Some("client_left"));
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}
