//! How many prompt tokens a prefill worker computes per second of work, measured on the
//! prefill legs as they end: what the planner's capacity rule uses before the latency
//! predictor has trained (a fleet hit by a burst at start cannot wait for fifty finished
//! requests to learn how much one worker takes; under the burst they finish slowly).
//!
//! Each leg adds its uncached tokens, and the time its worker was busy that no leg that
//! ended before it covered: from the later of the leg's start and the previous leg's end
//! there, to its own end. An idle worker's leg adds its whole duration; a worker kept
//! busy adds the gaps between the ends of its legs, so the rate is what it computes
//! flat out, batching included. (A leg that started before an idle gap and ended after
//! it does not add the gap back: the rate can only read high by what such gaps held.)

use std::collections::HashMap;
use std::time::Instant;

/// How much of the past each leg keeps (about the last 50 legs weigh).
const DECAY: f64 = 0.98;
/// Legs needed before a rate is given.
pub const MIN_LEGS: u32 = 3;

/// Decayed sums of the tokens prefill legs computed and the busy time they took.
#[derive(Debug, Default, Clone)]
pub struct PrefillRate {
    tokens: f64,
    busy_ms: f64,
    legs: u32,
    /// Per worker (base URL): when its last leg ended.
    last_end: HashMap<String, Instant>,
}

impl PrefillRate {
    /// Notes a leg on `worker` that computed `tokens` uncached prompt tokens from
    /// `started` to `ended`.
    pub fn note(&mut self, worker: &str, tokens: f64, started: Instant, ended: Instant) {
        if !(tokens >= 1.0 && tokens.is_finite()) || ended <= started {
            return;
        }
        let from = match self.last_end.get(worker) {
            Some(&last) => started.max(last),
            None => started,
        };
        let busy_ms = ended.saturating_duration_since(from).as_secs_f64() * 1000.0;
        match self.last_end.get_mut(worker) {
            Some(last) => *last = (*last).max(ended),
            None => {
                self.last_end.insert(worker.to_string(), ended);
            }
        }
        self.tokens = self.tokens * DECAY + tokens;
        self.busy_ms = self.busy_ms * DECAY + busy_ms;
        self.legs = self.legs.saturating_add(1);
    }

    /// Uncached prompt tokens per millisecond of a worker's busy time; `None` before
    /// [`MIN_LEGS`].
    pub fn tokens_per_ms(&self) -> Option<f64> {
        (self.legs >= MIN_LEGS && self.busy_ms > 0.0).then(|| self.tokens / self.busy_ms)
    }

    /// Forgets the workers whose base URL is not in `live`.
    pub fn retain_workers(&mut self, live: &[&str]) {
        self.last_end.retain(|w, _| live.contains(&w.as_str()));
    }
}

/// First tokens learned before [`FirstTokenTime::ms`] gives one.
const MIN_FIRST_TOKENS: u32 = 5;
/// How fast the first-token time follows the latest (about the last 30).
const FIRST_TOKEN_RATE: f64 = 1.0 / 32.0;

/// How long a role's first token takes when there is nothing to compute and nothing
/// ahead (a decode worker's first token after a transfer: the transfer and a step): a
/// running mean of those outcomes.
#[derive(Debug, Default, Clone, Copy)]
pub struct FirstTokenTime {
    mean_ms: f64,
    samples: u32,
}

impl FirstTokenTime {
    /// Notes a first token that took `actual_ms`.
    pub fn note(&mut self, actual_ms: f64) {
        if !(actual_ms.is_finite() && actual_ms > 0.0) {
            return;
        }
        self.mean_ms = if self.samples == 0 {
            actual_ms
        } else {
            self.mean_ms + FIRST_TOKEN_RATE * (actual_ms - self.mean_ms)
        };
        self.samples = self.samples.saturating_add(1);
    }

    /// The running mean; `None` before [`MIN_FIRST_TOKENS`].
    pub fn ms(&self) -> Option<f64> {
        (self.samples >= MIN_FIRST_TOKENS).then_some(self.mean_ms)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn an_idle_worker_counts_each_leg_whole_and_a_busy_one_the_gaps_between_ends() {
        let t0 = Instant::now();
        let mut rate = PrefillRate::default();
        rate.note("a", 1000.0, t0, t0 + ms(40));
        rate.note("a", 3000.0, t0 + ms(100), t0 + ms(200));
        assert_eq!(rate.tokens_per_ms(), None, "two legs are too few");
        // Nonsense is not a leg.
        rate.note("a", 0.0, t0, t0 + ms(10));
        rate.note("a", 500.0, t0 + ms(10), t0);
        assert_eq!(rate.tokens_per_ms(), None);
        // Sent while the last one ran: only its time after that one's end is its own.
        rate.note("a", 2000.0, t0 + ms(150), t0 + ms(260));
        let (tokens, busy) = (
            (1000.0 * DECAY + 3000.0) * DECAY + 2000.0,
            (40.0 * DECAY + 100.0) * DECAY + 60.0,
        );
        let got = rate.tokens_per_ms().unwrap();
        assert!((got - tokens / busy).abs() < 1e-9, "{got}");
        // Another worker's legs do not overlap the first's.
        rate.note("b", 1000.0, t0 + ms(150), t0 + ms(250));
        let got = rate.tokens_per_ms().unwrap();
        let (tokens, busy) = (tokens * DECAY + 1000.0, busy * DECAY + 100.0);
        assert!((got - tokens / busy).abs() < 1e-9, "{got}");
        // A worker that leaves is forgotten.
        rate.retain_workers(&["b"]);
        assert_eq!(rate.last_end.len(), 1);
    }

    #[test]
    fn a_worker_kept_busy_reads_at_its_throughput() {
        // Legs of 1,000 tokens sent 10 ms apart, each waiting behind the last: one ends
        // every 20 ms, so the worker does 50 tokens/ms however long each leg waited.
        let t0 = Instant::now();
        let mut rate = PrefillRate::default();
        for i in 0..200u64 {
            rate.note("a", 1000.0, t0 + ms(10 * i), t0 + ms(20 * (i + 1)));
        }
        assert!((rate.tokens_per_ms().unwrap() - 50.0).abs() < 1e-6);
    }

    #[test]
    fn a_first_token_with_nothing_to_compute_is_a_running_mean() {
        let mut first = FirstTokenTime::default();
        for _ in 0..4 {
            first.note(40.0);
        }
        assert_eq!(first.ms(), None, "too few yet");
        first.note(f64::NAN);
        first.note(-1.0);
        assert_eq!(first.ms(), None, "nonsense is not a sample");
        first.note(40.0);
        assert_eq!(first.ms(), Some(40.0));
        first.note(72.0);
        assert!((first.ms().unwrap() - 41.0).abs() < 1e-9);
    }
}
