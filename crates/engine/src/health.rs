//! Whether a worker can serve, as `GET /health` reports it: its scheduler thread is alive
//! and making progress, and the worker is not draining for shutdown.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::orchestrator::PrefillPool;
use crate::scheduler::EngineHandle;

/// What the scheduler thread last reported about itself. It beats before and after
/// every step and at least once a second while idle, so a beat older than a step can
/// take means the thread is stuck.
#[derive(Debug)]
pub struct Heartbeat {
    epoch: Instant,
    /// Milliseconds after `epoch` of the last beat.
    last_beat_ms: AtomicU64,
    /// Whether sequences were running or waiting at the last beat.
    busy: AtomicBool,
    /// Set when the scheduler thread ends, returning or unwinding.
    exited: AtomicBool,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            exited: AtomicBool::new(false),
        }
    }
}

impl Heartbeat {
    /// Records that the scheduler loop is alive, with or without work in hand.
    pub(crate) fn beat(&self, busy: bool) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.last_beat_ms.store(now, Ordering::SeqCst);
        self.busy.store(busy, Ordering::SeqCst);
    }

    /// A guard to move into the scheduler thread: dropping it (the thread returning or
    /// panicking) marks the heartbeat as exited.
    pub(crate) fn exit_guard(self: &Arc<Self>) -> ExitGuard {
        ExitGuard(self.clone())
    }

    /// The scheduler's condition: `queued` says whether requests are submitted but not
    /// yet picked up by the thread.
    pub fn condition(&self, wedged_after: Duration, queued: bool) -> SchedulerCondition {
        if self.exited.load(Ordering::SeqCst) {
            return SchedulerCondition::Exited;
        }
        let last = Duration::from_millis(self.last_beat_ms.load(Ordering::SeqCst));
        let silent = self.epoch.elapsed().saturating_sub(last);
        if silent > wedged_after && (queued || self.busy.load(Ordering::SeqCst)) {
            SchedulerCondition::Wedged { silent }
        } else {
            SchedulerCondition::Running
        }
    }
}

/// Marks its heartbeat as exited when dropped.
#[derive(Debug)]
pub(crate) struct ExitGuard(Arc<Heartbeat>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.0.exited.store(true, Ordering::SeqCst);
    }
}

/// How the scheduler thread is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerCondition {
    /// Alive, and stepping whenever there is work.
    Running,
    /// Work is queued or running but no step has completed for `silent`.
    Wedged {
        /// Time since the thread last showed progress.
        silent: Duration,
    },
    /// The thread has ended (panicked, or stopped for shutdown).
    Exited,
}

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
