//! The prompt work offered to the fleet and what a prefill worker can take of it: the
//! planner's capacity rule, which sizes the prefill pool from load it sees arrive
//! rather than from requests that already missed.
//!
//! - Demand: the uncached prompt tokens this gateway gave workers to compute per second
//!   (each worker's running total, [`Worker::claimed_prompt_tokens`], read at every
//!   decision). A decode worker prefilling locally counts too: that work is the prefill
//!   pool's whenever it is short.
//! - Capacity: the prefill predictor's TTFT for a typical prompt on an idle worker gives
//!   its tokens per second; until the predictor has trained, the rate measured on the
//!   prefill legs as they end does (`policy/predictor/prefill_rate.rs`: tokens per second of
//!   busy time, so a burst at start is sized within seconds). The pool is run at most
//!   at the utilization at which an M/D/1 queue's wait (its p90 taken as 2.5× the mean)
//!   keeps that prompt within the TTFT target.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdserve_protocol::WorkerRole;
use serde::Serialize;

use crate::fleet::registry::Worker;
use crate::policy::predictor::{Features, LatencyPredictor, Target};

/// Utilization bounds of the capacity rule.
const MIN_UTILIZATION: f64 = 0.3;
const MAX_UTILIZATION: f64 = 0.9;
/// The least time between two readings kept.
const MIN_READING_GAP: Duration = Duration::from_millis(500);
/// A queue wait's p90 over its mean, as the capacity rule takes it.
const P90_OVER_MEAN_WAIT: f64 = 2.5;

/// One reading of every live worker's total.
#[derive(Debug)]
struct Reading {
    at: Instant,
    totals: Vec<(String, u64)>,
}

/// Readings of the workers' claimed-token totals over the planner's window.
#[derive(Debug)]
pub struct DemandLog {
    readings: Mutex<VecDeque<Reading>>,
    keep: Duration,
}

impl DemandLog {
    /// A log that keeps readings for `keep`.
    pub fn new(keep: Duration) -> Self {
        Self {
            readings: Mutex::default(),
            keep,
        }
    }

    /// Reads `workers`' totals at `now`.
    pub fn record<'w>(&self, workers: impl Iterator<Item = &'w Arc<Worker>>, now: Instant) {
        let totals = workers
            .map(|w| (w.base.clone(), w.claimed_prompt_tokens()))
            .collect();
        let mut readings = self.readings.lock().unwrap_or_else(|e| e.into_inner());
        // Readings are kept `MIN_READING_GAP` apart, the newest replaced until then: with
        // the planner deciding on each `/planner` read, a client polling fast grows
        // nothing.
        let n = readings.len();
        if n >= 2 && now.duration_since(readings[n - 2].at) < MIN_READING_GAP {
            readings.pop_back();
        }
        readings.push_back(Reading { at: now, totals });
        while readings
            .front()
            .is_some_and(|r| now.duration_since(r.at) > self.keep)
        {
            readings.pop_front();
        }
    }

    /// Tokens per second over the last `span` (from the oldest reading within it to the
    /// newest), over the workers in both; `None` before two readings half a span apart.
    pub fn rate(&self, span: Duration) -> Option<f64> {
        let readings = self.readings.lock().unwrap_or_else(|e| e.into_inner());
        let newest = readings.back()?;
        let oldest = readings
            .iter()
            .find(|r| newest.at.duration_since(r.at) <= span)?;
        between(oldest, newest, span)
    }

    /// The highest rate over any stretch of `span` among the readings kept.
    pub fn peak(&self, span: Duration) -> Option<f64> {
        let readings = self.readings.lock().unwrap_or_else(|e| e.into_inner());
        let mut peak: Option<f64> = None;
        let mut from = 0;
        for (to, newest) in readings.iter().enumerate() {
            while from < to && newest.at.duration_since(readings[from].at) > span {
                from += 1;
            }
            if let Some(rate) = between(&readings[from], newest, span) {
                peak = Some(peak.map_or(rate, |p| p.max(rate)));
            }
        }
        peak
    }
}

/// Tokens per second from `old` to `new`, when they are at least half of `span` apart.
fn between(old: &Reading, new: &Reading, span: Duration) -> Option<f64> {
    let secs = new.at.duration_since(old.at).as_secs_f64();
    if secs < span.as_secs_f64() / 2.0 || secs <= 0.0 {
        return None;
    }
    let tokens: u64 = new
        .totals
        .iter()
        .filter_map(|(base, now)| {
            let then = old.totals.iter().find(|(b, _)| b == base)?.1;
            Some(now.saturating_sub(then))
        })
        .sum();
    Some(tokens as f64 / secs)
}

/// What the capacity rule saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DemandView {
    /// Uncached prompt tokens per second given to workers lately.
    pub tokens_per_s: Option<f64>,
    /// The highest such rate over the planner's window.
    pub peak_tokens_per_s: Option<f64>,
    /// What one idle prefill worker computes per second, as predicted (measured on the
    /// prefill legs before the predictor has trained).
    pub worker_tokens_per_s: Option<f64>,
    /// The utilization the pool is sized for.
    pub utilization: Option<f64>,
    /// Prefill workers the recent rate needs.
    pub needed_now: Option<usize>,
    /// Prefill workers the window's peak needs.
    pub needed_peak: Option<usize>,
}

impl DemandView {
    /// The view of `now` and `peak` tokens per second against `capacity`.
    pub fn new(now: Option<f64>, peak: Option<f64>, capacity: Option<Capacity>) -> Self {
        let needed = |rate: Option<f64>| {
            let (rate, c) = (rate?, capacity?);
            Some(((rate / (c.tokens_per_s * c.utilization)).ceil() as usize).max(1))
        };
        Self {
            tokens_per_s: now,
            peak_tokens_per_s: peak,
            worker_tokens_per_s: capacity.map(|c| c.tokens_per_s),
            utilization: capacity.map(|c| c.utilization),
            needed_now: needed(now),
            needed_peak: needed(peak),
        }
    }
}

/// What one prefill worker can take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Uncached prompt tokens per second on an idle worker.
    pub tokens_per_s: f64,
    /// The share of that to plan for.
    pub utilization: f64,
}

/// One idle prefill worker's capacity for the typical prompt, with the utilization at
/// which it keeps `ttft_target_ms`: from the trained predictor, else from the rate
/// measured on prefill legs; `None` before either.
pub fn prefill_capacity(
    predictor: &LatencyPredictor,
    workers: &[Arc<Worker>],
    ttft_target_ms: f64,
) -> Option<Capacity> {
    let typical = predictor.typical(WorkerRole::Prefill)?;
    if typical.uncached_tokens < 1.0 {
        return None;
    }
    let idle = Features {
        waiting: 0.0,
        running: 0.0,
        in_flight: 0.0,
        kv_usage: 0.0,
        queued_tokens: 0.0,
        ..typical
    };
    let times: Vec<f64> = workers
        .iter()
        .filter_map(|w| predictor.predict(WorkerRole::Prefill, Target::Ttft, &w.base, idle))
        .filter(|p| p.trained && p.ms > 0.0)
        .map(|p| p.ms)
        .collect();
    let service_ms = if times.is_empty() {
        typical.uncached_tokens / predictor.prefill_tokens_per_ms(WorkerRole::Prefill)?
    } else {
        times.iter().sum::<f64>() / times.len() as f64
    };
    Some(Capacity {
        tokens_per_s: typical.uncached_tokens / (service_ms / 1000.0),
        utilization: utilization_for(service_ms, ttft_target_ms),
    })
}

/// The utilization at which an M/D/1 queue of `service_ms` jobs keeps a job's wait
/// (its p90 taken as `P90_OVER_MEAN_WAIT` × the mean wait ρS / 2(1 − ρ)) plus its own
/// service within `target_ms`.
pub fn utilization_for(service_ms: f64, target_ms: f64) -> f64 {
    let room = (target_ms - service_ms) / (P90_OVER_MEAN_WAIT * service_ms);
    if !room.is_finite() || room <= 0.0 {
        return MIN_UTILIZATION;
    }
    (2.0 * room / (1.0 + 2.0 * room)).clamp(MIN_UTILIZATION, MAX_UTILIZATION)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::workers;

    #[test]
    fn rates_come_from_workers_in_both_readings() {
        let fleet = workers(WorkerRole::Prefill, &[9001, 9002]);
        let log = DemandLog::new(Duration::from_secs(60));
        let t0 = Instant::now();
        log.record(fleet.iter(), t0);
        assert_eq!(log.rate(Duration::from_secs(5)), None, "one reading");
        fleet[0].claim_prompt_tokens(1000);
        fleet[1].claim_prompt_tokens(3000);
        log.record(fleet.iter(), t0 + Duration::from_secs(2));
        // 4000 tokens in 2 s; a span of 10 s needs readings 5 s apart.
        assert_eq!(log.rate(Duration::from_secs(4)), Some(2000.0));
        assert_eq!(log.rate(Duration::from_secs(10)), None);
        // A worker that left counts for nothing; one that joined, from its first reading.
        let joined = workers(WorkerRole::Prefill, &[9003]).remove(0);
        let later = [fleet[1].clone(), joined.clone()];
        fleet[0].claim_prompt_tokens(7000);
        fleet[1].claim_prompt_tokens(1000);
        joined.claim_prompt_tokens(500);
        log.record(later.iter(), t0 + Duration::from_secs(4));
        assert_eq!(log.rate(Duration::from_secs(2)), Some(500.0));
        log.record(later.iter(), t0 + Duration::from_secs(6));
        // Readings closer than the gap replace the newest: polling grows nothing.
        let before = log.readings.lock().unwrap().len();
        for ms in 1..100 {
            log.record(
                later.iter(),
                t0 + Duration::from_secs(6) + Duration::from_millis(ms),
            );
        }
        assert_eq!(log.readings.lock().unwrap().len(), before + 1);
        assert_eq!(log.rate(Duration::from_secs(3)), Some(0.0));
        assert_eq!(log.peak(Duration::from_secs(2)), Some(2000.0));
    }

    #[test]
    fn the_utilization_leaves_the_target_room_for_the_queue() {
        // A 100 ms prompt against 300 ms: room 0.8, ρ = 1.6 / 2.6.
        assert!((utilization_for(100.0, 300.0) - 1.6 / 2.6).abs() < 1e-9);
        // Slow prompts against a tight target: the floor.
        assert_eq!(utilization_for(400.0, 300.0), MIN_UTILIZATION);
        // Fast ones: the ceiling.
        assert_eq!(utilization_for(1.0, 10_000.0), MAX_UTILIZATION);
        let capacity = Capacity {
            tokens_per_s: 10_000.0,
            utilization: 0.5,
        };
        let view = DemandView::new(Some(12_000.0), Some(4_000.0), Some(capacity));
        assert_eq!((view.needed_now, view.needed_peak), (Some(3), Some(1)));
        assert_eq!(DemandView::new(Some(1.0), None, None).needed_now, None);
    }

    #[test]
    fn before_the_predictor_trains_capacity_is_measured_on_prefill_legs() {
        let fleet = workers(WorkerRole::Prefill, &[9001, 9002]);
        let predictor = LatencyPredictor::new();
        let base = &fleet[0].base;
        let prompt = Features {
            uncached_tokens: 2000.0,
            prompt_tokens: 2000.0,
            ..Features::default()
        };
        let leg = |from: u64, to: u64| {
            let t0 = Instant::now();
            predictor.prefill_leg_ended(
                WorkerRole::Prefill,
                base,
                prompt,
                t0 + Duration::from_millis(from),
                t0 + Duration::from_millis(to),
            );
        };
        assert_eq!(prefill_capacity(&predictor, &fleet, 300.0), None);
        // Legs alone give no typical prompt: finished requests do.
        for i in 0..3 {
            leg(100 * i, 100 * i + 50);
        }
        assert_eq!(prefill_capacity(&predictor, &fleet, 300.0), None);
        predictor.observe(WorkerRole::Prefill, Target::Ttft, base, prompt, 50.0);
        // The regression has learned from one request; the rate alone is trusted.
        // 2,000 tokens in 50 ms of busy time each: 40,000 tokens/s.
        let capacity = prefill_capacity(&predictor, &fleet, 300.0).expect("measured");
        assert!(
            (capacity.tokens_per_s - 40_000.0).abs() < 1e-6,
            "{capacity:?}"
        );
        assert!((capacity.utilization - utilization_for(50.0, 300.0)).abs() < 1e-9);
    }
}
