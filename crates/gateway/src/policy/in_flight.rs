//! The open-request guard: a request counts on its worker until it ends, and then its
//! outcome reaches the worker's circuit breaker and the policy that routed it.

use std::sync::Arc;

use super::{Policy, RequestOutcome};
use crate::fleet::registry::Worker;

/// Counts one open request on a worker until dropped (so cancellation and errors count
/// too), then tells the policy that routed it how it ended.
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
    policy: Arc<dyn Policy>,
    outcome: RequestOutcome,
    /// Sent while the worker was evicted (panic routing): its outcome does not move the
    /// breaker, which steers traffic among healthy workers (health already says this one
    /// is down, and a stale open circuit would refuse it once it is back).
    to_evicted: bool,
}

impl InFlight {
    /// Marks a request routed by `policy` as open on `worker`.
    pub fn start(worker: Arc<Worker>, policy: Arc<dyn Policy>) -> Self {
        worker.request_opened();
        Self {
            to_evicted: worker.is_evicted(),
            worker,
            policy,
            outcome: RequestOutcome::Other,
        }
    }

    /// The worker the request is open on.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Records how the request ended (reported to the policy on drop).
    pub fn set_outcome(&mut self, outcome: RequestOutcome) {
        self.outcome = outcome;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.request_closed();
        let changed = match self.to_evicted {
            true => None,
            false => self.worker.breaker.record(self.outcome),
        };
        if let Some(state) = changed {
            tracing::warn!(url = %self.worker.base, circuit = ?state, "circuit breaker changed state");
        }
        self.policy.on_request_end(&self.worker, self.outcome);
    }
}
