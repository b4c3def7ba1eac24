//! Latency predictions for serving to an SLO: for a candidate worker of a role, the time
//! to first token and the time per output token a request would see there, from what the
//! gateway knows when it routes (the worker's queue and running counts and KV use from its
//! `/metrics`, this gateway's requests in flight on it, the prompt's length and how much of
//! it the worker holds).
//!
//! One model per role and target, trained online from every finished request: recursive
//! least squares of relative errors with forgetting (so it follows a fleet whose speed
//! drifts) over a few features, bounded in memory (a 9 × 9 matrix each), starting from a
//! prior that is sensible before the first sample. Each worker also keeps a correction
//! factor of its own (a slower machine in a pool), dropped when the worker leaves.
//!
//! Beside it, a queue estimate of TTFT: the prompt tokens still ahead on the worker and
//! the request's own, at the rate measured on prefill legs as they end (known after three
//! legs, where the regression needs fifty requests). A TTFT prediction follows the queue
//! estimate until the regression has learned, then whichever of the two errs less lately.
//! The mean absolute percentage error of the predictions made over a recent window is
//! published as `pdserve_gateway_predictor_error_ratio{role,target}`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Instant;

use pdserve_protocol::WorkerRole;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::fleet::registry::{ClaimId, Worker};
use prefill_rate::{FirstTokenTime, PrefillRate};
pub use rls::TRAINED_AFTER;
use rls::{Track, MAX_MS, MIN_MS};

mod prefill_rate;
mod rls;

/// How fast the typical request follows the requests learned from (about the last 20).
const TYPICAL_RATE: f64 = 0.05;
/// How fast a worker's own correction follows its errors.
const BIAS_RATE: f64 = 0.05;

/// What is predicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Time to first token (for a prefill worker: its leg; for a decode worker after a
    /// transfer: from the prefill leg's end to the first token).
    Ttft,
    /// Time per output token after the first.
    Tpot,
}

impl Target {
    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Target::Ttft => "ttft",
            Target::Tpot => "tpot",
        }
    }
}

/// The largest queue or running count believed: a worker reporting more is reporting
/// nonsense, and its prediction is unknown.
const MAX_COUNT: f64 = 100_000.0;
/// The longest prompt believed, in tokens.
const MAX_TOKENS: f64 = 10_000_000.0;

/// What the gateway knows of a candidate worker when it routes a request to it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Features {
    /// Prompt tokens the worker must compute (not in its cache).
    pub uncached_tokens: f64,
    /// Prompt tokens in all (what a transfer moves; the context decode attends over).
    pub prompt_tokens: f64,
    /// Requests waiting in the worker's queue (its `/metrics`).
    pub waiting: f64,
    /// Requests running on it (its `/metrics`).
    pub running: f64,
    /// Requests this gateway has in flight on it, this one not counted.
    pub in_flight: f64,
    /// The share of its KV cache in use, 0 to 1.
    pub kv_usage: f64,
    /// Prompt tokens this gateway sent it to compute that are still ahead of this
    /// request's: those sent and not computed, less what the worker has computed of them
    /// since at its measured rate ([`Worker::prompt_tokens_ahead`]).
    pub queued_tokens: f64,
}

/// How `worker` looks for a prompt of `prompt_tokens` of which it holds `matched`: its
/// last reported queue and KV use (none reported: only this gateway's count is known),
/// and this gateway's requests on it and the prompt tokens still ahead there at
/// `tokens_per_ms` (the role's measured rate; `None`: all not yet computed).
pub fn features_of(
    worker: &Worker,
    prompt_tokens: usize,
    matched: usize,
    tokens_per_ms: Option<f64>,
) -> Features {
    let reported = worker.reported_load();
    Features {
        uncached_tokens: prompt_tokens.saturating_sub(matched) as f64,
        prompt_tokens: prompt_tokens as f64,
        waiting: reported.map_or(0.0, |r| r.waiting),
        running: reported.map_or(0.0, |r| r.running),
        in_flight: worker.in_flight().max(0) as f64,
        kv_usage: reported.and_then(|r| r.kv_usage).unwrap_or(0.0),
        queued_tokens: match tokens_per_ms {
            Some(rate) => worker.prompt_tokens_ahead(rate, Instant::now()),
            None => worker.pending_prompt_tokens() as f64,
        },
    }
}

/// Length of a model's input vector.
const DIM: usize = 9;

impl Features {
    /// The features checked: `None` when any is not a finite, non-negative number within
    /// bounds (a worker that reports nonsense gets no prediction, so it cannot draw every
    /// request to itself).
    pub fn checked(self) -> Option<Self> {
        let counts = [self.waiting, self.running, self.in_flight];
        let tokens = [self.uncached_tokens, self.prompt_tokens, self.queued_tokens];
        let sane = counts
            .iter()
            .all(|c| c.is_finite() && (0.0..=MAX_COUNT).contains(c))
            && tokens
                .iter()
                .all(|t| t.is_finite() && (0.0..=MAX_TOKENS).contains(t))
            && self.kv_usage.is_finite();
        sane.then_some(Self {
            kv_usage: self.kv_usage.clamp(0.0, 1.0),
            ..self
        })
    }

    /// The model's input: a constant, the work (uncached thousands of tokens, and its
    /// square for attention), the load (the larger of the reported and the gateway's own
    /// count, since the scrape lags), the work queued behind the load, the context, KV
    /// use, and the prompt tokens queued ahead (thousands).
    fn vector(&self) -> [f64; DIM] {
        let work = self.uncached_tokens / 1000.0;
        let load = (self.waiting + self.running).max(self.in_flight);
        let context = self.prompt_tokens / 1000.0;
        [
            1.0,
            work,
            work * work,
            load,
            load * work,
            self.waiting,
            context,
            self.kv_usage,
            self.queued_tokens / 1000.0,
        ]
    }
}

/// A prediction for one worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Predicted milliseconds.
    pub ms: f64,
    /// Whether it is trusted over the prior: the queue estimate with a measured rate, or
    /// a regression that has learned from enough requests.
    pub trained: bool,
}

/// What one candidate worker is predicted to give a request, in milliseconds (`None`:
/// unknown, e.g. the worker reports nonsense load).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Forecast {
    /// Prompt tokens it holds.
    pub held: usize,
    /// Time to first token: a prefill worker's leg; a decode worker's first token after a
    /// transfer; a prefill_decode worker's whole prefill.
    pub ttft: Option<f64>,
    /// A decode worker's time to first token when it prefills the prompt itself
    /// (conditional disaggregation); `None` for other roles.
    pub ttft_local: Option<f64>,
    /// Time per output token (`None` for a prefill worker).
    pub tpot: Option<f64>,
}

impl Forecast {
    /// The `--expose-routing` header value: `ttft_ms=412.3; tpot_ms=31.0`.
    pub fn header_value(&self) -> Option<String> {
        let ttft = self.ttft?;
        Some(match self.tpot {
            Some(tpot) => format!("ttft_ms={ttft:.1}; tpot_ms={tpot:.1}"),
            None => format!("ttft_ms={ttft:.1}"),
        })
    }
}

/// The features of the workers one request was routed to, noted when each was chosen:
/// what the predictor learns from once the request's latencies are known. It also holds
/// the prompt tokens the request gave each worker to compute ([`Worker::claim_prompt_tokens`]),
/// until [`SeenFeatures::computed`] says they are, or it is dropped with the request.
#[derive(Debug, Default)]
pub struct SeenFeatures {
    seen: Mutex<Vec<(String, Features)>>,
    claims: Mutex<Vec<(std::sync::Arc<Worker>, ClaimId)>>,
}

impl Drop for SeenFeatures {
    fn drop(&mut self) {
        let claims = self.claims.get_mut().unwrap_or_else(|e| e.into_inner());
        for (worker, id) in claims.drain(..) {
            worker.release_prompt_tokens(id);
        }
    }
}

impl SeenFeatures {
    /// Notes that `worker` (its base URL) was chosen looking like `features` (a retried
    /// leg's worker replaces nothing: each worker keeps its own entry).
    pub fn note(&self, worker: &str, features: Features) {
        tracing::debug!(worker, ?features, "predictor features noted");
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|(base, _)| base != worker);
        seen.push((worker.to_string(), features));
    }

    /// Counts `tokens` of the prompt for `worker` to compute (a retried leg's worker
    /// keeps its own claim).
    pub fn claim(&self, worker: &std::sync::Arc<Worker>, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let id = worker.claim_prompt_tokens(tokens);
        self.claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((worker.clone(), id));
    }

    /// Releases what `worker` (its base URL) was given to compute: its prefill is done.
    pub fn computed(&self, worker: &str) {
        let mut claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        claims.retain(|(w, id)| {
            let mine = w.base == worker;
            if mine {
                w.prompt_tokens_computed(*id);
            }
            !mine
        });
    }

    /// How `worker` looked when it was chosen.
    pub fn of(&self, worker: &str) -> Option<Features> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.iter()
            .find(|(base, _)| base == worker)
            .map(|(_, f)| *f)
    }
}

/// One prediction's candidates: the regression's and the queue estimate's.
#[derive(Debug, Clone, Copy)]
struct Estimates {
    model_ms: f64,
    model_trained: bool,
    queue_ms: Option<f64>,
    prefers_queue: bool,
}

impl Estimates {
    /// The prediction made: the queue estimate where there is one and it is preferred,
    /// else the regression's.
    fn made(&self) -> Prediction {
        match self.queue_ms.filter(|_| self.prefers_queue) {
            Some(ms) => Prediction { ms, trained: true },
            None => Prediction {
                ms: self.model_ms,
                trained: self.model_trained,
            },
        }
    }
}

/// Labels of the error gauge.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    role: &'static str,
    target: &'static str,
}

/// The predictors of every role (see the module documentation).
#[derive(Debug)]
pub struct LatencyPredictor {
    /// Per role index ([`crate::policy::role_index`]) and target.
    models: Mutex<Vec<[Track; 2]>>,
    /// Per (worker, target): the log of its typical actual / predicted.
    bias: Mutex<HashMap<(String, Target), f64>>,
    /// Per role index: a running average of the TTFT features learned from.
    typical: Mutex<[Option<Features>; 4]>,
    /// Per role index: the prompt tokens its prefill legs computed per ms of busy time.
    prefill_rate: Mutex<[PrefillRate; 4]>,
    /// Per role index: its first tokens with nothing to compute and nothing ahead.
    first_token: Mutex<[FirstTokenTime; 4]>,
    errors: Family<ErrorLabels, Gauge<f64, AtomicU64>>,
}

impl Default for LatencyPredictor {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyPredictor {
    /// Untrained predictors, at their priors.
    pub fn new() -> Self {
        let models = (0..4)
            .map(|_| [Track::new(Target::Ttft), Track::new(Target::Tpot)])
            .collect();
        Self {
            models: Mutex::new(models),
            bias: Mutex::new(HashMap::new()),
            typical: Mutex::new([None; 4]),
            prefill_rate: Mutex::default(),
            first_token: Mutex::default(),
            errors: Family::default(),
        }
    }

    /// Registers `predictor_error_ratio` in `registry` (prefixed as the registry is).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "predictor_error_ratio",
            "Mean absolute percentage error of the latency predictions over the last 256 \
             finished requests, by role and target (ttft, tpot), as a ratio",
            self.errors.clone(),
        );
    }

    /// What `worker` (its base URL), of `role`, would give a request with `features`;
    /// `None` when its features are nonsense.
    pub fn predict(
        &self,
        role: WorkerRole,
        target: Target,
        worker: &str,
        features: Features,
    ) -> Option<Prediction> {
        let features = features.checked()?;
        let estimates = self.estimates(role, target, worker, &features);
        Some(estimates.made())
    }

    /// The regression's and the queue estimate's predictions for `features` (checked),
    /// and which of them a prediction follows now.
    fn estimates(
        &self,
        role: WorkerRole,
        target: Target,
        worker: &str,
        features: &Features,
    ) -> Estimates {
        let queue_ms = self.queue_estimate(role, target, features);
        let bias = self
            .bias
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(worker.to_string(), target))
            .copied()
            .unwrap_or(0.0);
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let track = &models[crate::policy::role_index(role)][target.index()];
        Estimates {
            model_ms: (track.model.predict(&features.vector()) * bias.exp()).clamp(MIN_MS, MAX_MS),
            model_trained: track.model.samples >= TRAINED_AFTER,
            queue_ms,
            prefers_queue: track.prefers_queue(),
        }
    }

    /// The queue estimate of `role`'s TTFT: the prompt tokens queued ahead on the worker
    /// and its own uncached ones, at the rate its role's prefill legs computed (a pool
    /// with none yet: another role's, the same model on alike machines; the rate counts
    /// a leg's whole busy time, its overheads too). What routing follows before the
    /// regression has learned, so a fleet hit by a burst at start is routed on its
    /// queues from the first few legs on. A leg with nothing to compute (a decode
    /// worker's first token after a transfer) takes the role's recent such first tokens
    /// with nothing ahead, plus the tokens ahead at the rate. `None` for TPOT, and before
    /// the rate or those first tokens are known.
    fn queue_estimate(&self, role: WorkerRole, target: Target, f: &Features) -> Option<f64> {
        if target != Target::Ttft {
            return None;
        }
        let ahead_ms = |tokens: f64| -> Option<f64> {
            if tokens <= 0.0 {
                return Some(0.0);
            }
            Some(tokens / self.queue_rate(role)?)
        };
        let ms = if f.uncached_tokens > 0.0 {
            ahead_ms(f.queued_tokens + f.uncached_tokens)?
        } else {
            let first = self.first_token.lock().unwrap_or_else(|e| e.into_inner())
                [crate::policy::role_index(role)]
            .ms()?;
            first + ahead_ms(f.queued_tokens)?
        };
        (ms.is_finite() && ms > 0.0).then(|| ms.clamp(MIN_MS, MAX_MS))
    }

    /// Learns that a request routed to `worker` with `features` took `actual_ms`: its
    /// prediction's error is recorded first (what the metric reports is the error of
    /// predictions made before their outcome was known).
    pub fn observe(
        &self,
        role: WorkerRole,
        target: Target,
        worker: &str,
        features: Features,
        actual_ms: f64,
    ) {
        let Some(features) = features.checked() else {
            return;
        };
        if !actual_ms.is_finite() || actual_ms <= 0.0 || actual_ms > MAX_MS {
            return;
        }
        let estimates = self.estimates(role, target, worker, &features);
        let predicted = estimates.made().ms;
        if target == Target::Ttft {
            self.note_typical(role, features);
            if features.uncached_tokens <= 0.0 && features.queued_tokens < 1.0 {
                self.first_token.lock().unwrap_or_else(|e| e.into_inner())
                    [crate::policy::role_index(role)]
                .note(actual_ms);
            }
        }
        // One line per lesson, to study the predictor's misses offline.
        tracing::debug!(
            role = role.as_str(),
            target = target.name(),
            worker,
            uncached_tokens = features.uncached_tokens,
            prompt_tokens = features.prompt_tokens,
            waiting = features.waiting,
            running = features.running,
            in_flight = features.in_flight,
            kv_usage = features.kv_usage,
            queued_tokens = features.queued_tokens,
            predicted_ms = predicted,
            regression_ms = estimates.model_ms,
            queue_ms = estimates.queue_ms,
            actual_ms,
            "predictor lesson"
        );
        let x = features.vector();
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let track = &mut models[crate::policy::role_index(role)][target.index()];
        track.made_errors.record(predicted, actual_ms);
        // The two are compared on the outcomes both predicted (a decode pool's first
        // tokens after a transfer, with nothing to compute, have no queue estimate).
        if let Some(queue_ms) = estimates.queue_ms {
            track.model_errors.record(estimates.model_ms, actual_ms);
            track.queue_errors.record(queue_ms, actual_ms);
        }
        let pooled = track.model.predict(&x);
        track.model.learn(&x, actual_ms);
        if let Some(ratio) = track.made_errors.ratio() {
            self.errors
                .get_or_create(&ErrorLabels {
                    role: role.as_str(),
                    target: target.name(),
                })
                .set(ratio);
        }
        drop(models);
        // The worker's own correction, against the pooled model's prediction.
        let mut bias = self.bias.lock().unwrap_or_else(|e| e.into_inner());
        let entry = bias.entry((worker.to_string(), target)).or_insert(0.0);
        let log_ratio = (actual_ms / pooled).ln().clamp(-3.0, 3.0);
        *entry += BIAS_RATE * (log_ratio - *entry);
    }

    /// A typical recent request of `role` as its workers looked when chosen: a running
    /// average of the features its TTFT model learned from (`None` before the first).
    pub fn typical(&self, role: WorkerRole) -> Option<Features> {
        self.typical.lock().unwrap_or_else(|e| e.into_inner())[crate::policy::role_index(role)]
    }

    fn note_typical(&self, role: WorkerRole, f: Features) {
        let mut typical = self.typical.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut typical[crate::policy::role_index(role)];
        let mix = |old: f64, new: f64| old + TYPICAL_RATE * (new - old);
        *slot = Some(match *slot {
            None => f,
            Some(t) => Features {
                uncached_tokens: mix(t.uncached_tokens, f.uncached_tokens),
                prompt_tokens: mix(t.prompt_tokens, f.prompt_tokens),
                waiting: mix(t.waiting, f.waiting),
                running: mix(t.running, f.running),
                in_flight: mix(t.in_flight, f.in_flight),
                kv_usage: mix(t.kv_usage, f.kv_usage),
                queued_tokens: mix(t.queued_tokens, f.queued_tokens),
            },
        });
    }

    /// Notes a prefill leg on `worker` (its base URL), of `role`, that looked like
    /// `features` when chosen and ran from `started` to `ended`: a sample of how fast the
    /// role's workers compute prompts, taken when the leg ends rather than when its
    /// request does, so the first seconds of a burst already give a rate.
    pub fn prefill_leg_ended(
        &self,
        role: WorkerRole,
        worker: &str,
        features: Features,
        started: Instant,
        ended: Instant,
    ) {
        let Some(features) = features.checked() else {
            return;
        };
        self.prefill_rate.lock().unwrap_or_else(|e| e.into_inner())
            [crate::policy::role_index(role)]
        .note(worker, features.uncached_tokens, started, ended);
    }

    /// Uncached prompt tokens per millisecond of busy time that `role`'s workers computed
    /// over their recent prefill legs (`None` before a few).
    pub fn prefill_tokens_per_ms(&self, role: WorkerRole) -> Option<f64> {
        self.prefill_rate.lock().unwrap_or_else(|e| e.into_inner())[crate::policy::role_index(role)]
            .tokens_per_ms()
    }

    /// The prompt tokens per ms the queue estimate takes `role`'s workers to compute: its
    /// own prefill legs' rate, else (a pool with none yet) another role's, the same model
    /// on alike machines; `None` before any.
    pub fn queue_rate(&self, role: WorkerRole) -> Option<f64> {
        let rates = self.prefill_rate.lock().unwrap_or_else(|e| e.into_inner());
        rates[crate::policy::role_index(role)]
            .tokens_per_ms()
            .or_else(|| rates.iter().find_map(PrefillRate::tokens_per_ms))
    }

    /// The recent mean absolute percentage error of `role`'s `target` predictions.
    pub fn error_ratio(&self, role: WorkerRole, target: Target) -> Option<f64> {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models[crate::policy::role_index(role)][target.index()]
            .made_errors
            .ratio()
    }

    /// Whether `role`'s `target` predictions are trusted: its regression has learned
    /// from enough requests, or (TTFT) a prefill rate has been measured for the queue
    /// estimate.
    pub fn trained(&self, role: WorkerRole, target: Target) -> bool {
        let queue = target == Target::Ttft && self.queue_rate(role).is_some();
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        queue
            || models[crate::policy::role_index(role)][target.index()]
                .model
                .samples
                >= TRAINED_AFTER
    }

    /// Forgets the workers whose base URL is not in `live` (their corrections leave with
    /// them).
    pub fn retain_workers(&self, live: &[&str]) {
        self.bias
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(worker, _), _| live.contains(&worker.as_str()));
        for rate in self
            .prefill_rate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            rate.retain_workers(live);
        }
    }
}

#[cfg(test)]
mod tests;
