//! Whether a worker can serve, as `GET /health` reports it: its scheduler thread is alive
//! and making progress, and the worker is not draining for shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use crate::heartbeat::{Heartbeat, SchedulerCondition};
use crate::orchestrator::PrefillPool;
use crate::scheduler::EngineHandle;

/// Why a worker cannot take requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    /// The scheduler thread has ended.
    #[error("the scheduler thread has stopped")]
    SchedulerExited,
    /// The scheduler has work but makes no progress.
    #[error(
        "the scheduler has not completed a step for {} s while requests are queued or running",
        .0.as_secs()
    )]
    SchedulerWedged(Duration),
    /// Shutdown was asked for; in-flight requests are finishing.
    #[error("the worker is shutting down")]
    Draining,
    /// An orchestrating decode worker has no warm prefill worker (yet).
    #[error("no prefill worker is warm: pre-warming the prefill -> decode pairs")]
    NoWarmPrefill,
}

impl Unhealthy {
    /// A short machine-readable name for the condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::SchedulerExited => "scheduler_exited",
            Self::SchedulerWedged(_) => "scheduler_wedged",
            Self::Draining => "draining",
            Self::NoWarmPrefill => "prefill_not_warm",
        }
    }
}

/// A worker's health, shared by its HTTP handlers and its shutdown.
#[derive(Debug)]
pub struct WorkerHealth {
    engine: EngineHandle,
    wedged_after: Duration,
    draining: AtomicBool,
    /// With `--prefill`: the prefill workers, one of which must be warm.
    prefill: Option<Arc<PrefillPool>>,
}

impl WorkerHealth {
    /// Health of the worker over `engine`, calling it wedged after `wedged_after`
    /// without progress.
    pub fn new(engine: EngineHandle, wedged_after: Duration) -> Self {
        Self {
            engine,
            wedged_after,
            draining: AtomicBool::new(false),
            prefill: None,
        }
    }

    /// Reports the worker unhealthy while none of `pool`'s prefill workers is warm.
    pub fn requiring_warm_prefill(mut self, pool: Arc<PrefillPool>) -> Self {
        self.prefill = Some(pool);
        self
    }

    /// From now on the worker reports itself as draining.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ok when the worker can serve, else the most serious reason it cannot.
    pub fn check(&self) -> Result<(), Unhealthy> {
        match self.engine.condition(self.wedged_after) {
            SchedulerCondition::Exited => Err(Unhealthy::SchedulerExited),
            SchedulerCondition::Wedged { silent } => Err(Unhealthy::SchedulerWedged(silent)),
            SchedulerCondition::Running if self.draining.load(Ordering::SeqCst) => {
                Err(Unhealthy::Draining)
            }
            SchedulerCondition::Running
                if self.prefill.as_ref().is_some_and(|p| p.warm_count() == 0) =>
            {
                Err(Unhealthy::NoWarmPrefill)
            }
            SchedulerCondition::Running => Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "health_tests.rs"]
mod tests;
