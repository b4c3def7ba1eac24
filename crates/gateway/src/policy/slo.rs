//! `slo`: route on predicted latency against the request's objectives. Each candidate's
//! TTFT (and, for decode and aggregated workers, TPOT) is predicted
//! ([`super::predictor`]) from its load and what its KV events hold of the prompt; the
//! candidate with the most headroom wins, 0.8 × TTFT's and 0.2 × TPOT's (llm-d's weights),
//! as shares of the objectives (without objectives, against the best prediction). The
//! worker that holds most of the prompt (at least 80 % of it) keeps it while its own
//! prediction still meets the objectives (without them: within a quarter of the best), so
//! prefix reuse is given up only when it costs the SLO. One request in a hundred goes to a
//! random candidate with a prediction, so every worker keeps teaching the predictor.
//!
//! Until the role's TTFT predictions are trusted (a rate measured for the queue estimate,
//! or a regression that has learned from enough requests), and for prompts without
//! token ids or pools without events, `precise_prefix` decides.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;
use rand::Rng;

use super::predictor::{features_of, Features, Forecast, LatencyPredictor, Target};
use super::{CacheMatch, Choice, MatchSource, Policy, PolicyStats, PrecisePrefix, PrefixMatch};
use super::{RequestOutcome, RouteRequest};
use crate::fleet::registry::Worker;
use crate::ingress::slo::Slo;

/// The share of the prompt a worker must hold for its affinity to count.
const AFFINITY_SHARE: f64 = 0.8;
/// Without objectives, how much slower than the best the affinity worker may be predicted.
const AFFINITY_SLACK: f64 = 1.25;
/// The share of requests routed at random among predicted candidates.
const EXPLORE: f64 = 0.01;
/// TTFT's and TPOT's weights in the headroom.
const TTFT_WEIGHT: f64 = 0.8;
const TPOT_WEIGHT: f64 = 0.2;

/// Routes on predicted latency (see the module documentation).
#[derive(Debug)]
pub struct SloPolicy {
    precise: PrecisePrefix,
    predictor: Arc<LatencyPredictor>,
}

impl SloPolicy {
    /// Predicted-latency routing with `precise` as the fallback and the source of prefix
    /// matches.
    pub fn new(precise: PrecisePrefix, predictor: Arc<LatencyPredictor>) -> Self {
        Self { precise, predictor }
    }

    /// Each of `workers`' forecast for a prompt of `prompt_len` tokens of which each
    /// holds `held`.
    fn forecasts(
        &self,
        role: WorkerRole,
        workers: &[Arc<Worker>],
        held: &[usize],
        prompt_len: usize,
    ) -> Vec<Forecast> {
        let rate = self.predictor.queue_rate(role);
        workers
            .iter()
            .zip(held)
            .map(|(worker, &held)| {
                let features = features_of(worker, prompt_len, held, rate);
                let predict = |target, f| {
                    self.predictor
                        .predict(role, target, &worker.base, f)
                        .map(|p| p.ms)
                };
                match role {
                    // After a transfer a decode worker computes nothing of the prompt.
                    WorkerRole::Decode => Forecast {
                        held,
                        ttft: predict(
                            Target::Ttft,
                            Features {
                                uncached_tokens: 0.0,
                                ..features
                            },
                        ),
                        ttft_local: predict(Target::Ttft, features),
                        tpot: predict(Target::Tpot, features),
                    },
                    WorkerRole::Prefill => Forecast {
                        held,
                        ttft: predict(Target::Ttft, features),
                        ..Forecast::default()
                    },
                    _ => Forecast {
                        held,
                        ttft: predict(Target::Ttft, features),
                        ttft_local: None,
                        tpot: predict(Target::Tpot, features),
                    },
                }
            })
            .collect()
    }

    /// The forecasts of `workers` for the request, with what each holds of its prompt;
    /// `None` while the role's predictions are untrusted or the prompt's tokens or the
    /// workers' events are unknown.
    fn forecast_all(
        &self,
        role: WorkerRole,
        workers: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<(Vec<Forecast>, Vec<usize>, usize)> {
        if workers.is_empty() || !self.predictor.trained(role, Target::Ttft) {
            return None;
        }
        let tokens = request.tokens.filter(|t| !t.is_empty())?;
        let held = self.precise.held_by_each(workers, tokens)?;
        let mut forecasts = self.forecasts(role, workers, &held, tokens.len());
        if request.local_prefill {
            // This decode worker will prefill the prompt itself.
            for f in &mut forecasts {
                f.ttft = f.ttft_local.or(f.ttft);
            }
        }
        Some((forecasts, held, tokens.len()))
    }
}

/// The index of the candidate to route to, or `None` when none has a prediction.
pub(crate) fn pick(
    candidates: &[Forecast],
    prompt_len: usize,
    slo: Slo,
    explore: f64,
) -> Option<usize> {
    let known: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].ttft.is_some())
        .collect();
    if known.is_empty() {
        return None;
    }
    if rand::rng().random_bool(explore.clamp(0.0, 1.0)) {
        return Some(known[rand::rng().random_range(0..known.len())]);
    }
    let best_ttft = known
        .iter()
        .filter_map(|&i| candidates[i].ttft)
        .fold(f64::INFINITY, f64::min);
    let best_tpot = known
        .iter()
        .filter_map(|&i| candidates[i].tpot)
        .fold(f64::INFINITY, f64::min);
    let ttft_goal = slo.ttft.map(|d| d.as_secs_f64() * 1000.0);
    let tpot_goal = slo.tpot.map(|d| d.as_secs_f64() * 1000.0);
    let headroom = |c: &Forecast| {
        let share = |predicted: f64, goal: Option<f64>, best: f64| match goal {
            Some(goal) => (goal - predicted) / goal,
            None => -(predicted / best.max(f64::MIN_POSITIVE)),
        };
        let ttft = share(c.ttft.unwrap_or(f64::INFINITY), ttft_goal, best_ttft);
        match c.tpot {
            Some(tpot) => TTFT_WEIGHT * ttft + TPOT_WEIGHT * share(tpot, tpot_goal, best_tpot),
            None => ttft,
        }
    };
    // Affinity: the worker holding most of the prompt, while it still meets the goals.
    let affine = known
        .iter()
        .copied()
        .max_by_key(|&i| candidates[i].held)
        .filter(|&i| candidates[i].held as f64 >= AFFINITY_SHARE * prompt_len as f64);
    if let Some(i) = affine {
        let c = &candidates[i];
        let ttft = c.ttft.unwrap_or(f64::INFINITY);
        let meets_ttft = match ttft_goal {
            Some(goal) => ttft <= goal,
            None => ttft <= AFFINITY_SLACK * best_ttft,
        };
        let meets_tpot = match (c.tpot, tpot_goal) {
            (Some(tpot), Some(goal)) => tpot <= goal,
            (Some(tpot), None) => tpot <= AFFINITY_SLACK * best_tpot,
            (None, _) => true,
        };
        if meets_ttft && meets_tpot {
            return Some(i);
        }
    }
    known
        .iter()
        .copied()
        .max_by(|&a, &b| headroom(&candidates[a]).total_cmp(&headroom(&candidates[b])))
}

impl Policy for SloPolicy {
    fn name(&self) -> &'static str {
        "slo"
    }

    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        self.choose(role, candidates, request).map(|c| c.worker)
    }

    fn choose(
        &self,
        role: WorkerRole,
        workers: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Choice> {
        let fallback = || self.precise.choose(role, workers, request);
        let Some((forecasts, held, prompt_len)) = self.forecast_all(role, workers, request) else {
            return fallback();
        };
        let Some(index) = pick(&forecasts, prompt_len, request.slo, EXPLORE) else {
            return fallback();
        };
        let chosen = workers[index].clone();
        let tokens = request.tokens.unwrap_or_default();
        self.precise.note_sent(&chosen, tokens, held[index]);
        tracing::debug!(
            %role,
            worker = %chosen.base,
            predicted_ttft_ms = forecasts[index].ttft,
            predicted_tpot_ms = forecasts[index].tpot,
            cached_tokens = held[index],
            "slo: the most headroom against the request's objectives"
        );
        Some(Choice {
            worker: chosen,
            cache: Some(CacheMatch {
                source: MatchSource::Events,
                matched: held[index],
                prompt_len,
                tokens: true,
            }),
            forecast: Some(forecasts[index]),
        })
    }

    fn forecast(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Vec<Forecast>> {
        self.forecast_all(role, candidates, request)
            .map(|(forecasts, _, _)| forecasts)
    }

    fn on_request_end(&self, worker: &Worker, outcome: RequestOutcome) {
        self.precise.on_request_end(worker, outcome);
    }

    fn cached_prefix(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<PrefixMatch> {
        self.precise.cached_prefix(role, candidates, request)
    }

    fn tree_size(&self) -> usize {
        self.precise.tree_size()
    }

    fn reads_prompt(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        self.precise.stats()
    }

    fn forget_sent(&self, worker: &Worker, tokens: &[u32]) {
        self.precise.forget_sent(worker, tokens);
    }

    fn retain_workers(&self, live: &[&str]) {
        self.precise.retain_workers(live);
        self.predictor.retain_workers(live);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn c(held: usize, ttft: f64, tpot: f64) -> Forecast {
        Forecast {
            held,
            ttft: Some(ttft),
            ttft_local: None,
            tpot: Some(tpot),
        }
    }

    fn slo(ttft: u64, tpot: u64) -> Slo {
        Slo {
            ttft: Some(Duration::from_millis(ttft)),
            tpot: Some(Duration::from_millis(tpot)),
        }
    }

    #[test]
    fn the_most_headroom_wins() {
        let pool = [c(0, 400.0, 30.0), c(0, 150.0, 35.0), c(0, 150.0, 60.0)];
        assert_eq!(pick(&pool, 1000, slo(500, 50), 0.0), Some(1));
        // Without objectives: against the best predictions.
        assert_eq!(pick(&pool, 1000, Slo::default(), 0.0), Some(1));
    }

    #[test]
    fn prefix_affinity_holds_until_it_costs_the_objective() {
        // The worker holding 90 % of the prompt is slower but still within the goal.
        let pool = [c(900, 300.0, 30.0), c(0, 120.0, 30.0)];
        assert_eq!(pick(&pool, 1000, slo(500, 50), 0.0), Some(0));
        // Past the goal it loses.
        let pool = [c(900, 700.0, 30.0), c(0, 120.0, 30.0)];
        assert_eq!(pick(&pool, 1000, slo(500, 50), 0.0), Some(1));
        // Holding too little of the prompt is no affinity.
        let pool = [c(500, 300.0, 30.0), c(0, 120.0, 30.0)];
        assert_eq!(pick(&pool, 1000, slo(500, 50), 0.0), Some(1));
        // Without objectives: kept within a quarter of the best.
        let pool = [c(900, 140.0, 30.0), c(0, 120.0, 30.0)];
        assert_eq!(pick(&pool, 1000, Slo::default(), 0.0), Some(0));
    }

    #[test]
    fn unknown_predictions_are_passed_over_and_none_means_fall_back() {
        let unknown = Forecast {
            held: 1000,
            ..Forecast::default()
        };
        assert_eq!(
            pick(&[unknown, c(0, 900.0, 90.0)], 1000, slo(100, 10), 0.0),
            Some(1)
        );
        assert_eq!(pick(&[unknown, unknown], 1000, slo(100, 10), 0.0), None);
        // Exploring picks among the known ones only.
        for _ in 0..50 {
            assert_eq!(
                pick(&[unknown, c(0, 1.0, 1.0)], 10, Slo::default(), 1.0),
                Some(1)
            );
        }
    }
}
