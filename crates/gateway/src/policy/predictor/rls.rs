//! The regression behind each prediction: recursive least squares over a few features,
//! with forgetting, from a prior that is sensible before the first sample, and the
//! windows of recent errors that say whether it or the queue estimate predicts better.

use super::{Target, DIM};

/// Samples after which a model counts as trained.
pub const TRAINED_AFTER: u64 = 50;
/// Recent absolute percentage errors kept per model.
const ERROR_WINDOW: usize = 256;
/// How much of the past each sample keeps (recursive least squares' forgetting factor):
/// the model's memory is about 1 / (1 − λ) = 500 samples.
const FORGETTING: f64 = 0.998;
/// The prior's confidence: the initial covariance's diagonal (large: data wins fast).
const PRIOR_COVARIANCE: f64 = 1.0e4;
/// The shortest and longest predictions made, in milliseconds.
pub(super) const MIN_MS: f64 = 0.05;
pub(super) const MAX_MS: f64 = 3_600_000.0;
/// The shortest outcome a sample is weighted by (shorter ones would weigh without bound).
const RELATIVE_FLOOR_MS: f64 = 1.0;

/// Recursive least squares over [`Features::vector`].
#[derive(Debug, Clone)]
pub(super) struct Model {
    theta: [f64; DIM],
    p: [[f64; DIM]; DIM],
    pub(super) samples: u64,
    /// The weights it started from, and starts from again if its own become non-finite.
    prior: [f64; DIM],
}

impl Model {
    /// A model starting from `prior` weights.
    pub(super) fn new(prior: [f64; DIM]) -> Self {
        let mut p = [[0.0; DIM]; DIM];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = PRIOR_COVARIANCE;
        }
        Self {
            theta: prior,
            p,
            samples: 0,
            prior,
        }
    }

    pub(super) fn predict(&self, x: &[f64; DIM]) -> f64 {
        let y: f64 = self.theta.iter().zip(x).map(|(t, v)| t * v).sum();
        y.clamp(MIN_MS, MAX_MS)
    }

    /// Learns from one sample, weighted by its own size: the squared error fitted is
    /// relative (each sample's inputs and outcome divided by the outcome), as the error
    /// published is, so the many short waits of a loaded pool count as much as its few
    /// long ones instead of being rounded off against them.
    pub(super) fn learn(&mut self, x: &[f64; DIM], actual: f64) {
        let weight = 1.0 / actual.max(RELATIVE_FLOOR_MS);
        let x: [f64; DIM] = std::array::from_fn(|i| x[i] * weight);
        let actual = actual * weight;
        let x = &x;
        let px: Vec<f64> = (0..DIM)
            .map(|i| (0..DIM).map(|j| self.p[i][j] * x[j]).sum())
            .collect();
        let denom = FORGETTING + x.iter().zip(&px).map(|(a, b)| a * b).sum::<f64>();
        if !denom.is_finite() || denom <= 0.0 {
            return;
        }
        let gain: Vec<f64> = px.iter().map(|v| v / denom).collect();
        let raw: f64 = self.theta.iter().zip(x).map(|(t, v)| t * v).sum();
        let residual = actual - raw;
        for (t, g) in self.theta.iter_mut().zip(&gain) {
            *t += g * residual;
        }
        // P = (P − g xᵀP) / λ, with xᵀP = (P x)ᵀ since P stays symmetric.
        for (row, g) in self.p.iter_mut().zip(&gain) {
            for (v, x) in row.iter_mut().zip(&px) {
                *v = (*v - g * x) / FORGETTING;
            }
        }
        // Forgetting without fresh excitation lets P grow without bound: cap it.
        let trace: f64 = (0..DIM).map(|i| self.p[i][i]).sum();
        if !trace.is_finite() || trace > PRIOR_COVARIANCE * DIM as f64 {
            let scale = if trace.is_finite() {
                PRIOR_COVARIANCE * DIM as f64 / trace
            } else {
                0.0
            };
            for row in &mut self.p {
                for v in row.iter_mut() {
                    *v *= scale;
                }
            }
            if scale == 0.0 {
                *self = Self {
                    samples: self.samples,
                    prior: self.prior,
                    ..Self::new(self.theta)
                };
            }
        }
        if self.theta.iter().any(|t| !t.is_finite()) {
            *self = Self::new(self.prior);
        }
        self.samples += 1;
    }
}

/// Weights before any sample: a small constant, a few tens of milliseconds per thousand
/// uncached tokens, and every request ahead costing about as much as this one.
fn prior_weights(target: Target) -> [f64; DIM] {
    match target {
        //          1     work  work²  load  load·work  waiting  context  kv  queued
        Target::Ttft => [20.0, 60.0, 5.0, 10.0, 30.0, 20.0, 0.0, 0.0, 30.0],
        Target::Tpot => [15.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 5.0, 0.0],
    }
}

/// The absolute percentage errors of the last [`ERROR_WINDOW`] predictions of one kind.
#[derive(Debug, Clone, Default)]
pub(super) struct ErrorWindow {
    errors: Vec<f64>,
    next: usize,
}

impl ErrorWindow {
    /// Records a prediction of `predicted` ms for an outcome of `actual` ms.
    pub(super) fn record(&mut self, predicted: f64, actual: f64) {
        let ape = (predicted - actual).abs() / actual;
        if self.errors.len() < ERROR_WINDOW {
            self.errors.push(ape);
        } else {
            self.errors[self.next] = ape;
        }
        self.next = (self.next + 1) % ERROR_WINDOW;
    }

    /// The mean of the window (`None` while empty).
    pub(super) fn ratio(&self) -> Option<f64> {
        (!self.errors.is_empty())
            .then(|| self.errors.iter().sum::<f64>() / self.errors.len() as f64)
    }
}

/// How fast the errors that choose between the regression and the queue estimate follow
/// the latest (about the last 30 outcomes weigh), so the regression's errors from before
/// it learned are soon forgotten.
const CHOICE_RATE: f64 = 1.0 / 32.0;

/// A running mean of absolute percentage errors.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RecentError(Option<f64>);

impl RecentError {
    /// Records a prediction of `predicted` ms for an outcome of `actual` ms.
    pub(super) fn record(&mut self, predicted: f64, actual: f64) {
        let ape = (predicted - actual).abs() / actual;
        self.0 = Some(match self.0 {
            None => ape,
            Some(mean) => mean + CHOICE_RATE * (ape - mean),
        });
    }
}

/// One role's predictions of one target: the regression, the recent errors of its
/// predictions and of the queue estimate's (which choose between them), and the window of
/// the predictions made (the published error); the first two on the same outcomes.
#[derive(Debug, Clone)]
pub(super) struct Track {
    pub(super) model: Model,
    pub(super) model_errors: RecentError,
    pub(super) queue_errors: RecentError,
    pub(super) made_errors: ErrorWindow,
}

impl Track {
    /// A track starting from `target`'s prior.
    pub(super) fn new(target: Target) -> Self {
        Self {
            model: Model::new(prior_weights(target)),
            model_errors: RecentError::default(),
            queue_errors: RecentError::default(),
            made_errors: ErrorWindow::default(),
        }
    }

    /// Whether the queue estimate, where there is one, predicts better than the
    /// regression: while the regression has not learned from [`TRAINED_AFTER`] samples,
    /// and after while the estimate's recent error is the smaller.
    pub(super) fn prefers_queue(&self) -> bool {
        if self.model.samples < TRAINED_AFTER {
            return true;
        }
        match (self.queue_errors.0, self.model_errors.0) {
            (Some(queue), Some(model)) => queue < model,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_gone_non_finite_starts_again_from_its_own_prior() {
        let prior = prior_weights(Target::Tpot);
        let mut model = Model::new(prior);
        model.theta[0] = f64::NAN;
        model.learn(&[1.0; DIM], 10.0);
        assert_eq!(model.theta, prior, "the TPOT prior, not the TTFT one");
        assert_eq!(model.samples, 1);
    }

    #[test]
    fn the_queue_estimate_is_preferred_untrained_and_then_only_while_it_errs_less() {
        let mut track = Track::new(Target::Ttft);
        assert!(track.prefers_queue(), "untrained");
        track.model.samples = TRAINED_AFTER;
        assert!(!track.prefers_queue(), "no errors to compare");
        for _ in 0..10 {
            track.model_errors.record(150.0, 100.0);
            track.queue_errors.record(110.0, 100.0);
        }
        assert!(track.prefers_queue());
        for _ in 0..200 {
            track.model_errors.record(101.0, 100.0);
        }
        assert!(
            !track.prefers_queue(),
            "the regression's early errors are forgotten"
        );
        assert!((track.model_errors.0.unwrap() - 0.01).abs() < 1e-3);
    }
}
