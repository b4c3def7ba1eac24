//! A request's journey as the dashboard shows it: which workers served it, in which
//! mode, and how it ended. One per generation request (in its `RequestContext`); the
//! legs note the workers that answered, and whoever sees the answer end (the route's
//! tail for a body, the relay for a stream) files it in the [`History`] once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use http::HeaderValue;
use pdserve_protocol::WorkerRole;

use super::history::History;
use super::request_record::{Finished, Hop, Mode, RequestRecord};
use crate::fleet::registry::Worker;
use crate::policy::CacheMatch;

#[derive(Debug, Default)]
struct Route {
    prefill: Option<Hop>,
    decode: Option<Hop>,
    worker: Option<Hop>,
    encoded: Option<Mode>,
}

/// One request's route and end (see the module documentation).
#[derive(Debug)]
pub struct Journey {
    request_id: HeaderValue,
    endpoint: &'static str,
    started: Instant,
    route: Mutex<Route>,
    /// A stream relay took over: it files the request when the stream ends.
    relayed: AtomicBool,
    /// When the stream's first byte left for the client, where something other than the
    /// relay sent it (the prefill's first token, sent before the decode worker answers).
    first_byte: OnceLock<Instant>,
    filed: AtomicBool,
}

impl Journey {
    /// The journey of the request `request_id` to `endpoint` that arrived at `started`.
    pub fn new(request_id: HeaderValue, endpoint: &'static str, started: Instant) -> Self {
        Self {
            request_id,
            endpoint,
            started,
            route: Mutex::new(Route::default()),
            relayed: AtomicBool::new(false),
            first_byte: OnceLock::new(),
            filed: AtomicBool::new(false),
        }
    }

    /// When the request arrived.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Notes that `worker` served its role's part (the last one noted per role stands:
    /// a retried leg's worker replaces the one that failed).
    pub fn served_by(&self, worker: &Arc<Worker>, cache: Option<CacheMatch>) {
        let hop = Some(Hop {
            worker: worker.clone(),
            cache,
        });
        let mut route = self.route.lock().unwrap_or_else(|e| e.into_inner());
        match worker.role() {
            WorkerRole::Prefill => route.prefill = hop,
            WorkerRole::Decode => route.decode = hop,
            WorkerRole::PrefillDecode => route.worker = hop,
            WorkerRole::Encode => {}
        }
    }

    /// Notes that the request went through the encoders first (`mode` is one of the two
    /// encoder modes).
    pub fn encoded(&self, mode: Mode) {
        self.route.lock().unwrap_or_else(|e| e.into_inner()).encoded = Some(mode);
    }

    /// Hands the filing to a stream relay.
    pub fn relay_takes_over(&self) {
        self.relayed.store(true, Ordering::Relaxed);
    }

    /// Notes that the stream's first byte is leaving now (the first call counts).
    pub fn first_byte_sent(&self) {
        let _ = self.first_byte.set(Instant::now());
    }

    /// When the stream's first byte left, if [`Self::first_byte_sent`] was called.
    pub fn first_byte(&self) -> Option<Instant> {
        self.first_byte.get().copied()
    }

    /// Whether a stream relay files this request.
    pub fn relayed(&self) -> bool {
        self.relayed.load(Ordering::Relaxed)
    }

    /// Files the request in `history`; only the first call counts.
    pub fn file(&self, history: &History, finished: Finished) {
        if self.filed.swap(true, Ordering::Relaxed) {
            return;
        }
        let route = std::mem::take(&mut *self.route.lock().unwrap_or_else(|e| e.into_inner()));
        let mode = match (&route.prefill, &route.decode, &route.worker) {
            _ if route.encoded.is_some() => route.encoded.unwrap_or(Mode::Unrouted),
            (_, _, Some(_)) => Mode::Aggregated,
            (None, Some(_), None) => Mode::PrefillSkipped,
            (Some(_), _, None) => Mode::Disaggregated,
            (None, None, None) => Mode::Unrouted,
        };
        history.finish(RequestRecord {
            finished_at: SystemTime::now(),
            request_id: self.request_id.clone(),
            endpoint: self.endpoint,
            mode,
            prefill: route.prefill,
            decode: route.decode,
            worker: route.worker,
            finished,
        });
    }
}
