//! Per-worker circuit breaker: `--cb-failure-threshold` consecutive failed requests open
//! it for `--cb-cooldown-secs`, or until the worker passes a health probe (a restarted
//! worker must not wait out a cooldown it no longer deserves); then one half-open trial
//! request decides whether it closes again or stays open for another cooldown.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;

/// How a routed request ended on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The worker answered and the answer reached the client.
    Success,
    /// The worker failed (transport error, 5xx, malformed answer, timeout).
    Failure,
    /// The request ended for another reason (client error, client gone, retry elsewhere).
    Other,
}

/// A circuit breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    /// Traffic flows.
    Closed,
    /// Traffic is held back after repeated failures.
    Open,
    /// One trial request is on its way; its outcome closes or re-opens the circuit.
    HalfOpen,
}

impl CircuitState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Open,
            2 => Self::HalfOpen,
            _ => Self::Closed,
        }
    }

    /// The state as exported in the `worker_circuit_state` metric (0, 1, 2).
    pub fn as_u8(self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::Open => 1,
            Self::HalfOpen => 2,
        }
    }
}

/// `--cb-failure-threshold` and `--cb-cooldown-secs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// Consecutive failed requests that open the circuit; 0 turns breaking off.
    pub failure_threshold: u32,
    /// How long an open circuit holds traffic back before a trial.
    pub cooldown: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            cooldown: Duration::from_secs(30),
        }
    }
}

/// Milliseconds since the first breaker was made (an atomically storable instant).
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// One worker's breaker. Lock-free: routing reads it on every request.
#[derive(Debug)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: AtomicU8,
    failures: AtomicU32,
    opened_at_ms: AtomicU64,
    /// A health probe passed since the circuit opened: the trial is due now.
    probe_passed: AtomicBool,
    /// Exported state (0 closed, 1 open, 2 half-open).
    gauge: Gauge,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(settings: BreakerSettings, gauge: Gauge) -> Self {
        gauge.set(0);
        Self {
            settings,
            state: AtomicU8::new(CircuitState::Closed.as_u8()),
            failures: AtomicU32::new(0),
            opened_at_ms: AtomicU64::new(0),
            probe_passed: AtomicBool::new(false),
            gauge,
        }
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        CircuitState::from_u8(self.state.load(Ordering::Acquire))
    }

    fn set(&self, state: CircuitState) {
        self.state.store(state.as_u8(), Ordering::Release);
        self.gauge.set(i64::from(state.as_u8()));
    }

    fn cooled_down(&self) -> bool {
        self.probe_passed.load(Ordering::Acquire)
            || now_ms().saturating_sub(self.opened_at_ms.load(Ordering::Acquire))
                >= self.settings.cooldown.as_millis() as u64
    }

    /// Opens the circuit from now.
    fn open(&self) {
        self.opened_at_ms.store(now_ms(), Ordering::Release);
        self.probe_passed.store(false, Ordering::Release);
        self.set(CircuitState::Open);
    }

    /// The worker passed a health probe: an open circuit lets its trial request through
    /// now instead of after the rest of the cooldown. Returns whether that changed.
    pub fn probe_passed(&self) -> bool {
        self.state() == CircuitState::Open && !self.probe_passed.swap(true, Ordering::AcqRel)
    }

    /// Whether routing may offer this worker: closed, or open with its cooldown over (a
    /// trial is due). A half-open worker already has its trial on the way.
    pub fn is_candidate(&self) -> bool {
        match self.state() {
            CircuitState::Closed => true,
            CircuitState::Open => self.cooled_down(),
            CircuitState::HalfOpen => false,
        }
    }

    /// Called when routing chose this worker: claims the half-open trial if the circuit
    /// is open. `false` means another request claimed it first (choose another worker).
    pub fn admit(&self) -> bool {
        match self.state() {
            CircuitState::Closed => true,
            CircuitState::HalfOpen => false,
            CircuitState::Open => {
                let claimed = self
                    .state
                    .compare_exchange(
                        CircuitState::Open.as_u8(),
                        CircuitState::HalfOpen.as_u8(),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok();
                if claimed {
                    self.gauge.set(i64::from(CircuitState::HalfOpen.as_u8()));
                }
                claimed
            }
        }
    }

    /// Records how a request on this worker ended; returns the new state when it changed.
    pub fn record(&self, outcome: RequestOutcome) -> Option<CircuitState> {
        if self.settings.failure_threshold == 0 {
            return None;
        }
        let before = self.state();
        match (before, outcome) {
            (CircuitState::HalfOpen, RequestOutcome::Success) => {
                self.failures.store(0, Ordering::Release);
                self.set(CircuitState::Closed);
            }
            (CircuitState::HalfOpen, RequestOutcome::Failure) => self.open(),
            // The trial ended without a verdict (client error, client gone): the next
            // request may try again at once.
            (CircuitState::HalfOpen, RequestOutcome::Other) => self.set(CircuitState::Open),
            // Read before writing: the common case (no failures) stays a shared cache line.
            (CircuitState::Closed, RequestOutcome::Success)
                if self.failures.load(Ordering::Relaxed) != 0 =>
            {
                self.failures.store(0, Ordering::Release);
            }
            (CircuitState::Closed, RequestOutcome::Failure) => {
                let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if failures >= self.settings.failure_threshold {
                    self.open();
                }
            }
            // Requests still finishing after the circuit opened do not change it.
            _ => {}
        }
        let after = self.state();
        (after != before).then_some(after)
    }

    /// Carries the state over from the breaker this one replaces (a re-registration).
    pub fn inherit(&self, previous: &CircuitBreaker) {
        self.failures
            .store(previous.failures.load(Ordering::Acquire), Ordering::Release);
        self.opened_at_ms.store(
            previous.opened_at_ms.load(Ordering::Acquire),
            Ordering::Release,
        );
        self.probe_passed.store(
            previous.probe_passed.load(Ordering::Acquire),
            Ordering::Release,
        );
        self.set(previous.state());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(threshold: u32, cooldown_ms: u64) -> CircuitBreaker {
        CircuitBreaker::new(
            BreakerSettings {
                failure_threshold: threshold,
                cooldown: Duration::from_millis(cooldown_ms),
            },
            Gauge::default(),
        )
    }

    #[test]
    fn opens_after_consecutive_failures_and_a_trial_decides() {
        let b = breaker(3, 50);
        b.record(RequestOutcome::Failure);
        b.record(RequestOutcome::Failure);
        b.record(RequestOutcome::Success);
        b.record(RequestOutcome::Failure);
        b.record(RequestOutcome::Failure);
        assert_eq!(
            b.state(),
            CircuitState::Closed,
            "a success resets the count"
        );
        assert_eq!(b.record(RequestOutcome::Failure), Some(CircuitState::Open));
        assert!(!b.is_candidate(), "open during the cooldown");
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.is_candidate(), "a trial is due");
        assert!(b.admit());
        assert!(!b.admit(), "only one trial at a time");
        assert!(!b.is_candidate());
        assert_eq!(b.record(RequestOutcome::Failure), Some(CircuitState::Open));
        assert!(!b.is_candidate(), "a failed trial restarts the cooldown");
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.admit());
        assert_eq!(
            b.record(RequestOutcome::Success),
            Some(CircuitState::Closed)
        );
        assert!(b.is_candidate());
    }

    #[test]
    fn a_passing_probe_makes_the_trial_due_at_once() {
        let b = breaker(1, 60_000);
        b.record(RequestOutcome::Failure);
        assert!(!b.is_candidate(), "open, a minute of cooldown ahead");
        assert!(b.probe_passed());
        assert!(!b.probe_passed(), "once per opening");
        assert!(b.is_candidate() && b.admit());
        assert!(!b.is_candidate(), "one trial at a time");
        assert_eq!(b.record(RequestOutcome::Failure), Some(CircuitState::Open));
        assert!(!b.is_candidate(), "a failed trial waits for the next probe");
        assert!(b.probe_passed());
        assert!(b.admit());
        assert_eq!(
            b.record(RequestOutcome::Success),
            Some(CircuitState::Closed)
        );
        assert!(!b.probe_passed(), "a closed circuit has nothing to clear");
    }

    #[test]
    fn an_inconclusive_trial_lets_the_next_request_try() {
        let b = breaker(1, 0);
        b.record(RequestOutcome::Failure);
        assert!(b.admit());
        b.record(RequestOutcome::Other);
        assert_eq!(b.state(), CircuitState::Open);
        assert!(b.is_candidate() && b.admit());
    }

    #[test]
    fn threshold_zero_never_opens() {
        let b = breaker(0, 0);
        for _ in 0..100 {
            b.record(RequestOutcome::Failure);
        }
        assert_eq!(b.state(), CircuitState::Closed);
    }
}
