//! One upstream worker: where it is, what it does, whether it is healthy, how loaded it is.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdserve_protocol::WorkerRole;
use prometheus_client::metrics::gauge::Gauge;
use reqwest::Url;
use serde::Serialize;

use super::circuit::{BreakerSettings, CircuitBreaker, CircuitState};
use super::prompt_backlog::{ClaimId, PromptBacklog};
use super::routing_line::RoutingLine;
use crate::endpoint::Endpoint;
use crate::error::GatewayError;

/// The largest `dp_size` a worker may declare (vLLM's largest data-parallel deployments
/// have hundreds of ranks).
pub const MAX_DP_SIZE: u32 = 1024;

/// Checks a declared number of data-parallel replicas: from 1 to [`MAX_DP_SIZE`].
pub fn check_dp_size(dp_size: u64) -> Result<u32, String> {
    u32::try_from(dp_size)
        .ok()
        .filter(|n| (1..=MAX_DP_SIZE).contains(n))
        .ok_or_else(|| format!("dp_size must be from 1 to {MAX_DP_SIZE}, got {dp_size}"))
}

/// Parses a worker base URL (`http://host:port`, optional path prefix, no trailing `/v1`).
pub fn parse_worker_url(flag: &str, raw: &str) -> Result<Url, GatewayError> {
    let trimmed = raw.trim().trim_end_matches('/');
    let url = Url::parse(trimmed)
        .map_err(|e| GatewayError::Config(format!("{flag} `{raw}` is not a URL: {e}")))?;
    if url.scheme() != "http" {
        return Err(GatewayError::Config(format!(
            "{flag} `{raw}`: only http:// workers are supported"
        )));
    }
    if url.host_str().is_none() {
        return Err(GatewayError::Config(format!("{flag} `{raw}` has no host")));
    }
    Ok(url)
}

/// What a worker is registered as: the fields of a `POST /instances` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The worker's part in serving.
    pub role: WorkerRole,
    /// Its base URL (scheme, host, port, optional path prefix; no trailing `/`).
    pub url: Url,
    /// Data-parallel replicas behind the URL.
    pub dp_size: u32,
    /// SGLang bootstrap port of a prefill worker, if it has one.
    pub bootstrap_port: Option<u16>,
    /// An encoder-cache consumer's push-connector (Mooncake) control addresses, one per
    /// data-parallel replica: the encoders push each embedding to the replica that will
    /// run the request.
    pub ec_zmq_addrs: Vec<String>,
    /// Where the worker publishes its KV-cache events (`tcp://host:port`), if it does.
    pub kv_events_endpoint: Option<String>,
    /// Where the worker answers KV-event replay requests, if it does.
    pub kv_events_replay_endpoint: Option<String>,
}

impl WorkerSpec {
    /// A spec with one replica and no bootstrap port.
    pub fn new(role: WorkerRole, url: Url) -> Self {
        Self {
            role,
            url,
            dp_size: 1,
            bootstrap_port: None,
            ec_zmq_addrs: Vec::new(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        }
    }

    /// The registry key: the base URL without a trailing `/`.
    pub fn key(&self) -> String {
        worker_key(&self.url)
    }
}

/// A worker's base URL (its registry key) hashed to 64 bits: equal URLs, equal ids, in
/// every gateway process of this build.
pub fn url_id(base: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(URL_ID_SEED).hash_one(base)
}

const URL_ID_SEED: u64 = 0x7365_6e74_746f_2121;

/// The registry key of a base URL: its text without a trailing `/`.
pub fn worker_key(url: &Url) -> String {
    url.as_str().trim_end_matches('/').to_string()
}

/// Whether requests are routed to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Receives traffic.
    Live,
    /// Failed `--fail-threshold` consecutive probes (or refused a connection); probed
    /// until it answers again or `--evicted-ttl` passes.
    Evicted,
}

/// Whether a worker takes requests now, and if not, which state keeps it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Routed to.
    Live,
    /// Failed its health probes or refused a connection; tried only in panic routing.
    Evicted,
    /// Its circuit breaker is open (or half-open, a trial on its way) after failed
    /// requests; tried only when no worker of its role has a closed breaker.
    BreakerOpen,
    /// Shutting down: its `/health` says `draining`. Never routed to.
    Draining,
}

impl WorkerState {
    /// The state's name in `/instances`, 503 messages and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Evicted => "evicted",
            Self::BreakerOpen => "breaker_open",
            Self::Draining => "draining",
        }
    }
}

/// One upstream worker as the registry knows it.
#[derive(Debug)]
pub struct Worker {
    /// The worker's registration.
    pub spec: WorkerSpec,
    /// Its base URL as text without a trailing `/` (logs, metrics labels, registry key).
    pub base: String,
    /// Its id, open requests and reported load, on one line for routing decisions.
    routing: RoutingLine,
    chat_url: Url,
    completions_url: Url,
    responses_url: Url,
    models_url: Url,
    health_url: Url,
    metrics_url: Url,
    /// Consecutive failed probes (or failed connections) since the last success.
    failures: AtomicU32,
    /// Whether routing may send requests here after recent failures.
    pub breaker: CircuitBreaker,
    /// The next data-parallel rank to name (round-robin over `dp_size`).
    dp_cursor: AtomicUsize,
    /// Mirrors the roster's health of this record (read by requests that succeed, to
    /// re-admit it without scanning the roster).
    evicted: AtomicBool,
    /// Its `/health` said it is draining for shutdown: it takes no new requests, not even
    /// in panic routing, until a probe passes again.
    draining: AtomicBool,
    /// What the worker's own `/metrics` said last (`--load-scrape-interval`).
    reported: Mutex<Option<ReportedLoad>>,
    /// Prompt tokens this gateway sent it to compute that it has not computed yet (claimed
    /// when a request is routed here, released when its prefill is done or it ends), with
    /// when each was sent.
    backlog: PromptBacklog,
    /// Prompt tokens this gateway has given it to compute, ever (the planner's demand).
    claimed_prompt_tokens: AtomicU64,
}

/// A worker's load as its own metrics report it (vLLM's `vllm:num_requests_*`, SGLang's
/// queue gauges): the same for every gateway replica, unlike in-flight counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReportedLoad {
    /// Requests queued on the worker.
    pub waiting: f64,
    /// Requests running on the worker.
    pub running: f64,
    /// Share of its KV cache in use (0-1), when it says.
    pub kv_usage: Option<f64>,
    /// Its prefix-cache hit ratio (0-1) since it started, when it says.
    pub prefix_cache_hit_ratio: Option<f64>,
    /// This gateway's open requests on the worker when the report came.
    in_flight_then: i64,
    /// When the report came.
    at: Instant,
    /// How long it stands for.
    valid_for: Duration,
}

impl Worker {
    /// A worker for `spec` whose in-flight count is `in_flight`, with a default breaker.
    pub fn new(spec: WorkerSpec, in_flight: Gauge) -> Self {
        Self::with_breaker(
            spec,
            in_flight,
            CircuitBreaker::new(BreakerSettings::default(), Gauge::default()),
        )
    }

    /// A worker for `spec` with its in-flight gauge and circuit breaker.
    pub fn with_breaker(spec: WorkerSpec, in_flight: Gauge, breaker: CircuitBreaker) -> Self {
        let root = spec.key();
        let join = |path: &str| {
            Url::parse(&format!("{root}{path}")).expect("a valid base URL plus a path is valid")
        };
        Self {
            chat_url: join(Endpoint::Chat.path()),
            completions_url: join(Endpoint::Completions.path()),
            responses_url: join(Endpoint::Responses.path()),
            models_url: join("/v1/models"),
            health_url: join("/health"),
            metrics_url: join("/metrics"),
            routing: RoutingLine::new(url_id(&root), in_flight),
            base: root,
            spec,
            failures: AtomicU32::new(0),
            breaker,
            dp_cursor: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            reported: Mutex::new(None),
            backlog: PromptBacklog::default(),
            claimed_prompt_tokens: AtomicU64::new(0),
        }
    }

    /// The worker's role.
    pub fn role(&self) -> WorkerRole {
        self.spec.role
    }

    /// The full URL of `endpoint` on this worker.
    pub fn url(&self, endpoint: Endpoint) -> &Url {
        match endpoint {
            Endpoint::Chat => &self.chat_url,
            Endpoint::Completions => &self.completions_url,
            Endpoint::Responses => &self.responses_url,
        }
    }

    /// The worker's `/v1/models` URL.
    pub fn models_url(&self) -> &Url {
        &self.models_url
    }

    /// The worker's `/health` URL (probed by the registry).
    pub fn health_url(&self) -> &Url {
        &self.health_url
    }

    /// The worker's `/metrics` URL (scraped for its load).
    pub fn metrics_url(&self) -> &Url {
        &self.metrics_url
    }

    /// `base` hashed ([`url_id`]): what per-worker state is looked up by on the routing
    /// path, where hashing and comparing each candidate's URL cost memory misses.
    pub fn id(&self) -> u64 {
        self.routing.id
    }

    /// Requests this gateway has open on the worker (exported as a metric, read for
    /// `/instances` and load balancing).
    pub fn in_flight(&self) -> i64 {
        self.routing.in_flight.get()
    }

    /// The worker's load for routing: the requests it reported waiting and running, plus
    /// those this gateway opened on it since the report; this gateway's in-flight count
    /// when there is no fresh report.
    pub fn load(&self) -> i64 {
        self.load_at(Instant::now())
    }

    /// [`Self::load`] as of `now` (a routing decision reads the clock once for a fleet).
    pub fn load_at(&self, now: Instant) -> i64 {
        self.routing.load_at(now)
    }

    /// The worker's last report, while it is fresh.
    pub fn reported_load(&self) -> Option<ReportedLoad> {
        let reported = *self.reported.lock().unwrap_or_else(|e| e.into_inner());
        reported.filter(|r| r.at.elapsed() <= r.valid_for)
    }

    /// Records what the worker's metrics said now, standing for `valid_for`.
    pub fn report_load(
        &self,
        waiting: f64,
        running: f64,
        kv_usage: Option<f64>,
        prefix_cache_hit_ratio: Option<f64>,
        valid_for: Duration,
    ) {
        let report = ReportedLoad {
            waiting,
            running,
            kv_usage,
            prefix_cache_hit_ratio,
            in_flight_then: self.in_flight(),
            at: Instant::now(),
            valid_for,
        };
        self.set_reported(Some(report));
    }

    /// Keeps `report` for [`Self::reported_load`] and routing's [`Self::load_at`].
    fn set_reported(&self, report: Option<ReportedLoad>) {
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        *reported = report;
        match report {
            Some(r) => self.routing.report(
                (r.waiting + r.running).round() as i64,
                r.in_flight_then,
                r.at,
                r.valid_for,
            ),
            None => self.routing.clear(),
        }
    }

    /// Forgets the worker's report (its metrics stopped answering).
    pub fn clear_reported_load(&self) {
        self.set_reported(None);
    }

    /// Prompt tokens sent here to compute and not computed yet (this gateway's).
    pub fn pending_prompt_tokens(&self) -> u64 {
        self.backlog.pending()
    }

    /// Of the prompt tokens sent here and not computed yet, those still ahead at `now`
    /// for a worker computing `tokens_per_ms` (see [`super::prompt_backlog`]).
    pub fn prompt_tokens_ahead(&self, tokens_per_ms: f64, now: Instant) -> f64 {
        self.backlog.ahead(tokens_per_ms, now)
    }

    /// Counts `tokens` more prompt tokens sent here to compute now.
    pub fn claim_prompt_tokens(&self, tokens: u64) -> ClaimId {
        self.claimed_prompt_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        self.backlog.claim(tokens, Instant::now())
    }

    /// Prompt tokens this gateway has given the worker to compute since it joined.
    pub fn claimed_prompt_tokens(&self) -> u64 {
        self.claimed_prompt_tokens.load(Ordering::Relaxed)
    }

    /// Counts claim `id`'s tokens computed now.
    pub fn prompt_tokens_computed(&self, id: ClaimId) {
        self.backlog.release(id, Some(Instant::now()));
    }

    /// Counts claim `id`'s tokens abandoned (its request ended before they were).
    pub fn release_prompt_tokens(&self, id: ClaimId) {
        self.backlog.release(id, None);
    }

    /// Counts a request opened on the worker (see [`crate::policy::InFlight`]).
    pub fn request_opened(&self) {
        self.routing.in_flight.inc();
    }

    /// Counts a request on the worker ended.
    pub fn request_closed(&self) {
        self.routing.in_flight.dec();
    }

    /// Consecutive failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Counts a failure; returns the new consecutive count.
    pub(crate) fn record_failure(&self) -> u32 {
        self.failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Clears the failure count.
    pub(crate) fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Whether the roster holds this record as evicted.
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Relaxed)
    }

    pub(crate) fn set_evicted(&self, evicted: bool) {
        self.evicted.store(evicted, Ordering::Relaxed);
    }

    /// Whether its last `/health` said it is draining for shutdown.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Notes whether it is draining; returns whether that changed.
    pub(crate) fn set_draining(&self, draining: bool) -> bool {
        self.draining.swap(draining, Ordering::Relaxed) != draining
    }

    /// What keeps routing from this worker, if anything: draining, evicted or its
    /// breaker open (`/instances`' `state`; a refusal's reason).
    pub fn state(&self) -> WorkerState {
        if self.is_draining() {
            WorkerState::Draining
        } else if self.is_evicted() {
            WorkerState::Evicted
        } else if self.circuit() != CircuitState::Closed {
            WorkerState::BreakerOpen
        } else {
            WorkerState::Live
        }
    }

    /// Carries health counters over from the record this one replaces.
    pub(crate) fn inherit(&self, previous: &Worker) {
        self.failures.store(previous.failures(), Ordering::Relaxed);
        self.set_evicted(previous.is_evicted());
        self.set_draining(previous.is_draining());
        self.breaker.inherit(&previous.breaker);
        self.dp_cursor.store(
            previous.dp_cursor.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let report = *previous.reported.lock().unwrap_or_else(|e| e.into_inner());
        self.set_reported(report);
    }

    /// The circuit breaker's state.
    pub fn circuit(&self) -> CircuitState {
        self.breaker.state()
    }

    /// The data-parallel rank the next request names, round-robin; `None` for a worker
    /// with one replica.
    pub fn next_dp_rank(&self) -> Option<u32> {
        let size = self.spec.dp_size.max(1) as usize;
        (size > 1).then(|| (self.dp_cursor.fetch_add(1, Ordering::Relaxed) % size) as u32)
    }
}
