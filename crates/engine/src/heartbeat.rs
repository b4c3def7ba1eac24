//! The scheduler thread's heartbeat: what it last reported about itself, and the
//! condition read from it (running, wedged, exited).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
