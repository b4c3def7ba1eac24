//! The simulated engine's own metric (`pdserve_sim_*`), on `--sim` workers only.

use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Lateness buckets in seconds: 5 ms is the bound a valid run keeps 99% of steps under.
const LATENESS_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];

/// How faithfully a sim worker keeps its profile's time.
#[derive(Debug)]
pub struct SimMetrics {
    /// How late each step ended against the time the profile gave it: a machine too busy
    /// to keep the simulated time shows here, and its results are not valid.
    pub step_lateness_seconds: Histogram,
}

impl Default for SimMetrics {
    fn default() -> Self {
        Self {
            step_lateness_seconds: Histogram::new(LATENESS_BUCKETS),
        }
    }
}

impl SimMetrics {
    /// Registers under `sim_`.
    pub fn register(&self, r: &mut Registry) {
        let r = r.sub_registry_with_prefix("sim");
        r.register(
            "step_lateness_seconds",
            "How late each simulated step ended against the time its profile gave it",
            self.step_lateness_seconds.clone(),
        );
    }
}
