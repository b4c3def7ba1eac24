//! A request's journey as the dashboard shows it: which workers served it, in which
//! mode, and how it ended. One per generation request (in its `RequestContext`); the
//! legs note the workers that answered, and whoever sees the answer end (the route's
//! tail for a body, the relay for a stream) files it in the [`History`] once. Filing
//! also teaches the latency predictor what each worker's part took, against how the
//! worker looked when it was chosen.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use http::HeaderValue;
use pdserve_protocol::WorkerRole;

use super::history::History;
use super::request_record::{Finished, Hop, Mode, RequestRecord};
use crate::fleet::registry::Worker;
use crate::ingress::slo::Slo;
use crate::policy::predictor::{Features, LatencyPredictor, SeenFeatures, Target};
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
    /// The chosen workers' features, noted by routing.
    seen: SeenFeatures,
    /// The predictor that learns from this request when it is filed.
    learning: OnceLock<Arc<LatencyPredictor>>,
    /// The prefill leg that succeeded last: its worker and how long it took.
    prefill_leg: Mutex<Option<(String, Duration)>>,
    /// The answering leg's time to its first byte (a stream's), and its worker.
    answer_head: Mutex<Option<(String, Duration)>>,
    /// The objectives it is served to, set at intake.
    slo: OnceLock<Slo>,
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
            seen: SeenFeatures::default(),
            learning: OnceLock::new(),
            prefill_leg: Mutex::new(None),
            answer_head: Mutex::new(None),
            slo: OnceLock::new(),
        }
    }

    /// Notes the objectives the request is served to (its attainment is counted when it
    /// is filed).
    pub fn aim_at(&self, slo: Slo) {
        let _ = self.slo.set(slo);
    }

    /// Where routing notes the chosen workers' features.
    pub fn seen(&self) -> &SeenFeatures {
        &self.seen
    }

    /// Has `predictor` learn from this request once it is filed.
    pub fn learn_into(&self, predictor: Arc<LatencyPredictor>) {
        let _ = self.learning.set(predictor);
    }

    /// Notes that the answering leg's stream on `worker` began after `took`.
    pub fn answer_began(&self, worker: &Worker, took: Duration) {
        self.seen.computed(&worker.base);
        *self.answer_head.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((worker.base.clone(), took));
    }

    /// Notes that the prefill leg on `worker` answered after `took`.
    pub fn prefill_took(&self, worker: &Worker, took: Duration) {
        self.seen.computed(&worker.base);
        if let (Some(predictor), Some(features)) = (self.learning.get(), self.seen.of(&worker.base))
        {
            let ended = Instant::now();
            let started = ended.checked_sub(took).unwrap_or(ended);
            predictor.prefill_leg_ended(worker.role(), &worker.base, features, started, ended);
        }
        *self.prefill_leg.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((worker.base.clone(), took));
    }

    /// When the request arrived.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Notes that `worker` served its role's part, what it held of the prompt and what it
    /// was predicted to give when chosen (the last one noted per role stands: a retried
    /// leg's worker replaces the one that failed).
    pub fn served_by(
        &self,
        worker: &Arc<Worker>,
        cache: Option<CacheMatch>,
        forecast: Option<crate::policy::predictor::Forecast>,
    ) {
        let hop = Some(Hop {
            worker: worker.clone(),
            cache,
            forecast,
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
        if let Some(predictor) = self.learning.get() {
            let prefill = self
                .prefill_leg
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            let answer_head = self
                .answer_head
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            let lesson = Lesson {
                predictor,
                seen: &self.seen,
                finished: &finished,
                prefill,
                answer_head,
            };
            lesson.teach(mode, &route);
        }
        history.finish(RequestRecord {
            finished_at: SystemTime::now(),
            request_id: self.request_id.clone(),
            endpoint: self.endpoint,
            mode,
            prefill: route.prefill,
            decode: route.decode,
            worker: route.worker,
            finished,
            slo: self.slo.get().copied().unwrap_or_default(),
        });
    }
}

/// What a filed request teaches the predictor.
struct Lesson<'a> {
    predictor: &'a LatencyPredictor,
    seen: &'a SeenFeatures,
    finished: &'a Finished,
    /// The prefill leg's worker and duration, over P/D.
    prefill: Option<(String, Duration)>,
    /// The answering leg's worker and its time to first byte.
    answer_head: Option<(String, Duration)>,
}

impl Lesson<'_> {
    /// Each worker's part, by the mode: an aggregated worker's (or a decode worker
    /// prefilling alone) TTFT and TPOT; over P/D the prefill leg's duration as the prefill
    /// worker's TTFT, the decode leg's own time to first byte as the decode worker's (the
    /// transfer and its first step: it computes nothing of the prompt, its features say
    /// no uncached tokens; the client's TTFT may not wait for it when the first token
    /// comes from prefill), and its TPOT. Only requests that ended well teach; a body has
    /// no TTFT, only its prefill leg.
    fn teach(&self, mode: Mode, route: &Route) {
        if self.finished.outcome != "ok" {
            return;
        }
        let ttft = self.finished.ttft;
        let tpot = self.finished.itl;
        match mode {
            Mode::Aggregated => self.both(route.worker.as_ref(), ttft, tpot, |f| f),
            Mode::PrefillSkipped => self.both(route.decode.as_ref(), ttft, tpot, |f| f),
            Mode::Disaggregated => {
                let Some((prefill_worker, took)) = &self.prefill else {
                    return;
                };
                self.one(
                    WorkerRole::Prefill,
                    prefill_worker,
                    Target::Ttft,
                    Some(*took),
                    |f| f,
                );
                let decode = route.decode.as_ref();
                let decode_head = self
                    .answer_head
                    .as_ref()
                    .filter(|(worker, _)| decode.is_some_and(|h| h.worker.base == *worker))
                    .map(|(_, took)| *took);
                let imported = |f: Features| Features {
                    uncached_tokens: 0.0,
                    ..f
                };
                self.both(decode, decode_head, tpot, imported);
            }
            _ => {}
        }
    }

    fn both(
        &self,
        hop: Option<&Hop>,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
        adjust: impl Fn(Features) -> Features + Copy,
    ) {
        let Some(hop) = hop else {
            return;
        };
        let role = hop.worker.role();
        self.one(role, &hop.worker.base, Target::Ttft, ttft, adjust);
        self.one(role, &hop.worker.base, Target::Tpot, tpot, adjust);
    }

    fn one(
        &self,
        role: WorkerRole,
        worker: &str,
        target: Target,
        actual: Option<Duration>,
        adjust: impl Fn(Features) -> Features,
    ) {
        let (Some(features), Some(actual)) = (self.seen.of(worker), actual) else {
            return;
        };
        let ms = actual.as_secs_f64() * 1000.0;
        self.predictor
            .observe(role, target, worker, adjust(features), ms);
    }
}
