//! How fast a worker computes a prompt when nothing else is in its way, measured on the
//! requests that found their worker idle: what the planner's capacity rule uses before
//! the latency predictor has trained (a fleet hit by a burst at start cannot wait for
//! fifty finished requests to learn how much one worker takes).

use std::collections::VecDeque;

/// Idle samples kept.
const KEPT: usize = 32;
/// Samples needed before a rate is given.
pub const MIN_SAMPLES: usize = 3;

/// Recent (uncached prompt tokens, milliseconds) of legs that found their worker idle.
#[derive(Debug, Default, Clone)]
pub struct IdleService {
    samples: VecDeque<(f64, f64)>,
}

impl IdleService {
    /// Notes a leg that computed `tokens` uncached prompt tokens in `ms` on an idle worker.
    pub fn note(&mut self, tokens: f64, ms: f64) {
        if !(tokens >= 1.0 && ms > 0.0 && tokens.is_finite() && ms.is_finite()) {
            return;
        }
        if self.samples.len() == KEPT {
            self.samples.pop_front();
        }
        self.samples.push_back((tokens, ms));
    }

    /// Uncached prompt tokens per millisecond over the samples kept (their total tokens
    /// over their total time, so a long prompt counts for its length); `None` before
    /// [`MIN_SAMPLES`].
    pub fn tokens_per_ms(&self) -> Option<f64> {
        if self.samples.len() < MIN_SAMPLES {
            return None;
        }
        let (tokens, ms) = self
            .samples
            .iter()
            .fold((0.0, 0.0), |(t, m), (st, sm)| (t + st, m + sm));
        Some(tokens / ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_total_tokens_over_total_time_of_the_recent_samples() {
        let mut idle = IdleService::default();
        idle.note(1000.0, 40.0);
        idle.note(3000.0, 100.0);
        assert_eq!(idle.tokens_per_ms(), None, "two samples are too few");
        // Nonsense is not a sample.
        idle.note(0.0, 10.0);
        idle.note(500.0, f64::NAN);
        idle.note(500.0, -1.0);
        assert_eq!(idle.tokens_per_ms(), None);
        idle.note(2000.0, 60.0);
        assert_eq!(idle.tokens_per_ms(), Some(6000.0 / 200.0));
        // Only the most recent are kept: a fleet that slowed is seen slow.
        for _ in 0..KEPT {
            idle.note(1000.0, 100.0);
        }
        assert_eq!(idle.tokens_per_ms(), Some(10.0));
    }
}
