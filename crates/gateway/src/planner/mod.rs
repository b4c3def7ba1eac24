//! The P:D planner signal: how many prefill and how many decode workers the fleet should
//! have, from the SLO attainment of the requests that finished over a window and the
//! latency the predictors give each pool now and with one worker fewer. In the spirit of
//! Dynamo's load-based planner (targets of TTFT and ITL), it moves each pool by one worker
//! per decision, except where the capacity rule gives a count:
//! - a pool grows when the requests missed the objective that pool serves (TTFT misses
//!   are the prefill pool's when its leg is the larger part of the TTFT, else the decode
//!   pool's; TPOT misses the decode pool's), or when it is predicted to miss its target
//!   at its current load;
//! - the prefill pool also grows, ahead of any miss and towards the count they need (at
//!   most doubling it or adding 4, as Kubernetes' HPA by default), when the prompt
//!   tokens arriving lately need more workers than it has at the utilization that keeps
//!   the TTFT target ([`demand`]);
//! - while the prefill pool is short, the decode pool does not grow: decode workers then
//!   prefill locally (SLO-aware disaggregation), and their TPOT misses are the prefill
//!   pool's shortage, not theirs;
//! - a pool shrinks when the window met the objectives and the pool is predicted to keep
//!   its target with a margin ([`SHRINK_MARGIN`]) when its load is spread over one worker
//!   fewer, and (prefill) the window's peak demand fits one worker fewer.
//!
//! `GET /planner` answers the latest decision, `pdserve_planner_desired_workers{role}`
//! carries it, and `pdserve up --autoscale` acts on it.

pub mod demand;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdserve_protocol::WorkerRole;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::fleet::registry::Worker;
use crate::ingress::slo::Slo;
use crate::observe::history::{Attainment, Sample};
use crate::policy::predictor::{features_of, Features, LatencyPredictor, Target};
use crate::serving::Serving;
use demand::{prefill_capacity, DemandLog, DemandView};

/// The share of requests that must meet an objective for the window to count as met.
pub const ATTAINMENT_GOAL: f64 = 0.9;
/// A pool shrinks only while predicted within this share of its target with one worker
/// fewer.
pub const SHRINK_MARGIN: f64 = 0.5;
/// Workers a pool may grow by at once even where that is more than doubling it (HPA's
/// default `Pods` scale-up policy).
const MAX_ADDED_AT_ONCE: usize = 4;
/// Requests with an objective a window needs before its attainment decides anything.
const MIN_REQUESTS: u32 = 10;
/// The targets when the gateway sets no objectives (Dynamo's planner defaults).
const DEFAULT_TTFT: Duration = Duration::from_millis(500);
const DEFAULT_TPOT: Duration = Duration::from_millis(50);

/// How the planner decides.
#[derive(Debug, Clone, Copy)]
pub struct PlannerSettings {
    /// How often it decides.
    pub interval: Duration,
    /// The finished requests it looks back over.
    pub window: Duration,
    /// The pools' targets (the gateway's `--slo-*`, else 500 ms TTFT and 50 ms TPOT).
    pub targets: Slo,
}

impl PlannerSettings {
    /// Deciding every `interval` over `window`, aiming at the gateway's objectives.
    pub fn new(interval: Duration, window: Duration, objectives: Slo) -> Self {
        Self {
            interval,
            window,
            targets: Slo {
                ttft: objectives.ttft.or(Some(DEFAULT_TTFT)),
                tpot: objectives.tpot.or(Some(DEFAULT_TPOT)),
            },
        }
    }
}

/// One pool as the planner sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PoolView {
    /// Live workers.
    pub workers: usize,
    /// The pool's objective predicted for a typical request at its load now, in
    /// milliseconds (prefill: TTFT; decode: TPOT).
    pub predicted_ms: Option<f64>,
    /// The same with the load spread over one worker fewer.
    pub predicted_one_fewer_ms: Option<f64>,
}

/// What the finished requests of the window say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct WindowView {
    /// Requests that finished.
    pub requests: u32,
    /// Of those with objectives, how many met them.
    pub attainment: Attainment,
    /// The prefill legs' p90, in milliseconds (a count-weighted mean of the seconds').
    pub prefill_p90_ms: Option<f64>,
    /// The decode legs' time to first byte, p90.
    pub decode_ttfb_p90_ms: Option<f64>,
}

/// A decision: the desired counts and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Desired prefill workers (at least 1).
    pub prefill: usize,
    /// Desired decode workers (at least 1).
    pub decode: usize,
    /// Why, in a sentence per pool.
    pub reason: String,
    /// The live counts it started from.
    pub current: Counts,
    /// The share of the window's requests that met their TTFT and TPOT objectives.
    pub attainment: Shares,
    /// The targets the pools are sized for, in milliseconds.
    pub targets_ms: Targets,
    /// What the predictors say of each pool.
    pub pools: Pools,
    /// The prompt work arriving, and the prefill workers it needs.
    pub demand: DemandView,
    /// The window looked at, in seconds.
    pub window_secs: u64,
    /// When it was decided, Unix milliseconds.
    pub decided_at_ms: u64,
}

/// Live worker counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Counts {
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
}

/// Attainment shares (`None`: no request with that objective in the window).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Shares {
    /// TTFT.
    pub ttft: Option<f64>,
    /// TPOT.
    pub tpot: Option<f64>,
}

/// The targets, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Targets {
    /// TTFT.
    pub ttft: f64,
    /// TPOT.
    pub tpot: f64,
}

/// Both pools' views.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pools {
    /// The prefill pool (its TTFT).
    pub prefill: PoolView,
    /// The decode pool (its TPOT).
    pub decode: PoolView,
}

/// The desired counts for `window`, `prefill` and `decode` (see the module documentation).
pub fn decide(
    window: &WindowView,
    prefill: &PoolView,
    decode: &PoolView,
    demand: &DemandView,
    targets: Slo,
) -> Plan {
    let ttft_target = targets.ttft.unwrap_or(DEFAULT_TTFT).as_secs_f64() * 1000.0;
    let tpot_target = targets.tpot.unwrap_or(DEFAULT_TPOT).as_secs_f64() * 1000.0;
    let a = &window.attainment;
    let counted = |met: u32, missed: u32| met + missed >= MIN_REQUESTS;
    let (ttft_share, tpot_share) = a.shares();
    let below = |s: Option<f64>| s.is_some_and(|s| s < ATTAINMENT_GOAL);
    // Growing takes enough requests; shrinking any sign of misses holds back.
    let ttft_missed = counted(a.ttft_met, a.ttft_missed) && below(ttft_share);
    let tpot_missed = counted(a.tpot_met, a.tpot_missed) && below(tpot_share);
    let struggling = below(ttft_share) || below(tpot_share);
    // Whose TTFT misses they are: the larger stage's.
    let prefill_stage_larger = match (window.prefill_p90_ms, window.decode_ttfb_p90_ms) {
        (Some(p), Some(d)) => p >= d,
        (Some(_), None) => true,
        (None, _) => false,
    };
    let step =
        |pool: &PoolView, grow: Option<(usize, String)>, target: f64, name: &str, room: bool| {
            let shrink_fits = room
                && pool
                    .predicted_one_fewer_ms
                    .is_some_and(|ms| ms <= SHRINK_MARGIN * target);
            if let Some((to, why)) = grow {
                // At most twice the pool or 4 more at once, whichever is larger (the default
                // scale-up policies of Kubernetes' HPA): a capacity measured on the first
                // requests may be far off, but a small pool hit by a burst must not take
                // several cooldowns to reach what it needs.
                let most = (pool.workers * 2).max(pool.workers + MAX_ADDED_AT_ONCE);
                let to = to.clamp(pool.workers + 1, most);
                (to, format!("{name} +{}: {why}", to - pool.workers))
            } else if pool.workers > 1 && !struggling && shrink_fits {
                (
                    pool.workers - 1,
                    format!(
                        "{name} -1: the window met its objectives and {} workers are predicted \
                     at {:.0} ms against a target of {target:.0} ms",
                        pool.workers - 1,
                        pool.predicted_one_fewer_ms.unwrap_or_default()
                    ),
                )
            } else {
                (pool.workers.max(1), format!("{name} holds"))
            }
        };
    let share = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{:.0}%", s * 100.0));
    // Arriving work gives a count (scale up at once); misses and predictions one more.
    let needed = demand.needed_now.unwrap_or(0);
    let prefill_grow = if let Some(why) = demand_over(demand, prefill.workers) {
        Some((needed, why))
    } else if ttft_missed && prefill_stage_larger {
        Some((
            prefill.workers + 1,
            format!(
                "{} of requests met their TTFT objective and the prefill leg is its larger part",
                share(ttft_share)
            ),
        ))
    } else {
        predicted_over(prefill, ttft_target, "TTFT").map(|why| (prefill.workers + 1, why))
    };
    let prefill_short = prefill_grow.is_some();
    let decode_grow = if prefill_short {
        None
    } else if tpot_missed {
        Some(format!(
            "{} of requests met their TPOT objective",
            share(tpot_share)
        ))
    } else if ttft_missed && !prefill_stage_larger {
        Some(format!(
            "{} of requests met their TTFT objective and the decode side's first token is \
             its larger part",
            share(ttft_share)
        ))
    } else {
        predicted_over(decode, tpot_target, "TPOT")
    }
    .map(|why| (decode.workers + 1, why));
    let decode_waits = prefill_short && (tpot_missed || ttft_missed);
    // The window's peak must fit one worker fewer too (unknown: the predictions decide).
    let prefill_room = demand.needed_peak.is_none_or(|n| n < prefill.workers);
    let (prefill_n, prefill_why) =
        step(prefill, prefill_grow, ttft_target, "prefill", prefill_room);
    let (decode_n, mut decode_why) = step(decode, decode_grow, tpot_target, "decode", true);
    if decode_waits && decode_n == decode.workers {
        decode_why.push_str(
            " (its misses wait on the prefill pool: short of prefill, decode workers prefill)",
        );
    }
    Plan {
        prefill: prefill_n.max(1),
        decode: decode_n.max(1),
        reason: format!("{prefill_why}; {decode_why}"),
        current: Counts {
            prefill: prefill.workers,
            decode: decode.workers,
        },
        attainment: Shares {
            ttft: ttft_share,
            tpot: tpot_share,
        },
        targets_ms: Targets {
            ttft: ttft_target,
            tpot: tpot_target,
        },
        pools: Pools {
            prefill: *prefill,
            decode: *decode,
        },
        demand: *demand,
        window_secs: 0,
        decided_at_ms: 0,
    }
}

fn demand_over(demand: &DemandView, workers: usize) -> Option<String> {
    let needed = demand.needed_now.filter(|&n| n > workers)?;
    Some(format!(
        "{:.0} prompt tokens/s arriving need {needed} workers at {:.0} tokens/s each, run at \
         {:.0}% to keep the TTFT target",
        demand.tokens_per_s.unwrap_or_default(),
        demand.worker_tokens_per_s.unwrap_or_default(),
        demand.utilization.unwrap_or_default() * 100.0
    ))
}

fn predicted_over(pool: &PoolView, target: f64, what: &str) -> Option<String> {
    let ms = pool.predicted_ms.filter(|&ms| ms > target)?;
    Some(format!(
        "a typical request is predicted a {what} of {ms:.0} ms at the pool's load, over the \
         target of {target:.0} ms"
    ))
}

/// The window's view from the per-second samples of the last `window`.
pub fn window_view(samples: &[Sample], window: Duration) -> WindowView {
    let take = (window.as_secs() as usize).min(samples.len());
    let recent = &samples[samples.len() - take..];
    let mut view = WindowView::default();
    let weighted = |pick: fn(&Sample) -> Option<crate::observe::history::Percentiles>| {
        let (sum, n) = recent
            .iter()
            .filter_map(pick)
            .fold((0.0, 0u32), |(s, n), p| {
                (s + p.p90 * f64::from(p.count), n + p.count)
            });
        (n > 0).then(|| sum / f64::from(n))
    };
    for s in recent {
        view.requests += s.requests;
        view.attainment.add(&s.slo);
    }
    view.prefill_p90_ms = weighted(|s| s.prefill_ms);
    view.decode_ttfb_p90_ms = weighted(|s| s.decode_ttfb_ms);
    view
}

/// `role`'s pool: its live workers, and its objective predicted for a typical request
/// now and with its load spread over one worker fewer.
fn pool_view(predictor: &LatencyPredictor, role: WorkerRole, workers: &[Arc<Worker>]) -> PoolView {
    let n = workers.len();
    let target = match role {
        WorkerRole::Prefill => Target::Ttft,
        _ => Target::Tpot,
    };
    let typical = predictor.typical(role);
    let rate = predictor.queue_rate(role);
    let mean_at = |scale: f64| -> Option<f64> {
        let typical = typical?;
        let predictions: Vec<f64> = workers
            .iter()
            .filter_map(|w| {
                let now = features_of(w, typical.prompt_tokens as usize, 0, rate);
                let f = Features {
                    uncached_tokens: typical.uncached_tokens,
                    waiting: now.waiting * scale,
                    running: now.running * scale,
                    in_flight: now.in_flight * scale,
                    ..now
                };
                predictor
                    .predict(role, target, &w.base, f)
                    .filter(|p| p.trained)
            })
            .map(|p| p.ms)
            .collect();
        (!predictions.is_empty())
            .then(|| predictions.iter().sum::<f64>() / predictions.len() as f64)
    };
    PoolView {
        workers: n,
        predicted_ms: mean_at(1.0),
        predicted_one_fewer_ms: (n > 1)
            .then(|| mean_at(n as f64 / (n - 1) as f64))
            .flatten(),
    }
}

/// Labels of the desired-workers gauge.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleLabels {
    role: &'static str,
}

/// The planner: its settings, its latest decision and its gauge.
#[derive(Debug)]
pub struct Planner {
    settings: PlannerSettings,
    demand: DemandLog,
    latest: Mutex<Option<Plan>>,
    desired: Family<RoleLabels, Gauge>,
}

impl Planner {
    /// A planner that has not decided yet.
    pub fn new(settings: PlannerSettings) -> Self {
        Self {
            settings,
            demand: DemandLog::new(settings.window),
            latest: Mutex::new(None),
            desired: Family::default(),
        }
    }

    /// Registers `planner_desired_workers` in `registry` (`pdserve_` prefixed by it).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "pdserve_planner_desired_workers",
            "Workers the P:D planner wants in each pool (GET /planner says why)",
            self.desired.clone(),
        );
    }

    /// Decides now from `serving`'s fleet, history and predictors, and keeps it.
    pub fn decide_now(&self, serving: &Serving) -> Plan {
        let roster = serving.registry.snapshot();
        let window = window_view(&serving.metrics.history().samples(), self.settings.window);
        let prefill = pool_view(
            &serving.predictor,
            WorkerRole::Prefill,
            roster.live(WorkerRole::Prefill),
        );
        let decode = pool_view(
            &serving.predictor,
            WorkerRole::Decode,
            roster.live(WorkerRole::Decode),
        );
        let workers = roster
            .live(WorkerRole::Prefill)
            .iter()
            .chain(roster.live(WorkerRole::Decode));
        self.demand.record(workers, Instant::now());
        let span = self.demand_span();
        let ttft_target = self.settings.targets.ttft.unwrap_or(DEFAULT_TTFT);
        let demand = DemandView::new(
            self.demand.rate(span),
            self.demand.peak(span),
            prefill_capacity(
                &serving.predictor,
                roster.live(WorkerRole::Prefill),
                ttft_target.as_secs_f64() * 1000.0,
            ),
        );
        let mut plan = decide(&window, &prefill, &decode, &demand, self.settings.targets);
        plan.window_secs = self.settings.window.as_secs();
        plan.decided_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64;
        for (role, n) in [("prefill", plan.prefill), ("decode", plan.decode)] {
            self.desired
                .get_or_create(&RoleLabels { role })
                .set(n as i64);
        }
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan.clone());
        plan
    }

    /// The stretch the arriving rate is measured over: two decisions, at least 3 s.
    fn demand_span(&self) -> Duration {
        (self.settings.interval * 2).max(Duration::from_secs(3))
    }

    /// The latest decision, or one made now when there is none yet (or none is made on
    /// a schedule).
    pub fn latest(&self, serving: &Serving) -> Plan {
        if self.settings.interval.is_zero() {
            return self.decide_now(serving);
        }
        let latest = self
            .latest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        latest.unwrap_or_else(|| self.decide_now(serving))
    }

    /// Decides every interval until the task is aborted; an interval of 0 decides only
    /// when `/planner` is read.
    pub fn spawn(self: Arc<Self>, serving: Arc<Serving>) -> Option<tokio::task::JoinHandle<()>> {
        if self.settings.interval.is_zero() {
            return None;
        }
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.settings.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let plan = self.decide_now(&serving);
                tracing::debug!(prefill = plan.prefill, decode = plan.decode, reason = %plan.reason, "planner");
            }
        }))
    }
}

#[cfg(test)]
mod tests;
