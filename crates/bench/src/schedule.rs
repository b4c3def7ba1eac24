//! When each request is sent: a closed loop at fixed concurrency, or an open loop of
//! planned send times: Poisson arrivals (exponential gaps) at a mean request rate, or a
//! trace's timestamps.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Mixed into the seed so arrival times do not correlate with the prompts.
const ARRIVAL_SEED_SALT: u64 = 0x5eed_a221_7a15_0001;

/// Send times `0, g1, g1 + g2, ...` of `count` requests with exponential gaps of mean
/// `1 / rate` seconds: a Poisson process of rate `rate`, fixed by `seed`.
pub fn poisson_offsets(count: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(seed ^ ARRIVAL_SEED_SALT);
    // `rate` is validated positive and finite by the flag parser.
    let gaps = Exp::new(rate).unwrap_or_else(|_| Exp::new(1.0).expect("1 is a valid rate"));
    let mut at = 0.0f64;
    (0..count)
        .map(|i| {
            if i > 0 {
                at += gaps.sample(&mut rng);
            }
            Duration::from_secs_f64(at)
        })
        .collect()
}

/// Hands out the right to send request `i`.
#[derive(Debug)]
pub enum Dispatcher {
    /// At most this many requests in flight; a request goes when a slot frees.
    Concurrency(Arc<Semaphore>),
    /// Request `i` goes at `start + offsets[i]`, whatever is in flight.
    Arrivals {
        /// When the run began.
        start: Instant,
        /// Planned send time of each request, from `start`.
        offsets: Vec<Duration>,
    },
}

impl Dispatcher {
    /// A closed loop of `concurrency` slots.
    pub fn concurrency(concurrency: usize) -> Self {
        Self::Concurrency(Arc::new(Semaphore::new(concurrency.max(1))))
    }

    /// An open loop of Poisson arrivals counted from `start`.
    pub fn poisson(count: usize, rate: f64, seed: u64, start: Instant) -> Self {
        Self::Arrivals {
            start,
            offsets: poisson_offsets(count, rate, seed),
        }
    }

    /// An open loop sending request `i` at `start + offsets[i]` (a trace's timestamps).
    pub fn at(start: Instant, offsets: Vec<Duration>) -> Self {
        Self::Arrivals { start, offsets }
    }

    /// Request `i`'s planned send time from the start (open loop only).
    pub fn scheduled(&self, i: usize) -> Option<Duration> {
        match self {
            Self::Concurrency(_) => None,
            Self::Arrivals { offsets, .. } => offsets.get(i).copied(),
        }
    }

    /// Waits until request `i` may go; the permit (if any) must live as long as it runs.
    /// Cancel-safe: dropping the future gives nothing away.
    pub async fn ready(&self, i: usize) -> Option<OwnedSemaphorePermit> {
        match self {
            Self::Concurrency(slots) => slots.clone().acquire_owned().await.ok(),
            Self::Arrivals { start, offsets } => {
                let at = offsets.get(i).copied().unwrap_or_default();
                tokio::time::sleep_until(*start + at).await;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_rate_matches_over_many_samples() {
        // Fixed seeds make this deterministic; the bound is ~6 standard errors wide.
        for (rate, seed) in [(10.0, 0), (2.5, 1), (200.0, 42)] {
            let n = 20_000;
            let offsets = poisson_offsets(n, rate, seed);
            assert_eq!(offsets[0], Duration::ZERO);
            let span = offsets[n - 1].as_secs_f64();
            let measured = (n - 1) as f64 / span;
            assert!(
                (measured / rate - 1.0).abs() < 0.05,
                "rate {rate}: measured {measured}"
            );
            // Exponential gaps: the standard deviation equals the mean.
            let gaps: Vec<f64> = offsets
                .windows(2)
                .map(|w| (w[1] - w[0]).as_secs_f64())
                .collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            assert!(
                (var.sqrt() / mean - 1.0).abs() < 0.05,
                "cv {}",
                var.sqrt() / mean
            );
        }
    }

    #[test]
    fn poisson_offsets_depend_only_on_the_seed() {
        assert_eq!(poisson_offsets(100, 5.0, 3), poisson_offsets(100, 5.0, 3));
        assert_ne!(poisson_offsets(100, 5.0, 3), poisson_offsets(100, 5.0, 4));
        let o = poisson_offsets(100, 5.0, 3);
        assert!(o.windows(2).all(|w| w[0] <= w[1]));
    }
}
