//! The prompt tokens this gateway gave one worker to compute and has not seen computed,
//! each with when it was sent, so the work still ahead of a new request can be told
//! from the work merely outstanding: a prefill half done counts half. With a rate (prompt
//! tokens the worker computes per ms) the backlog drains as a fluid queue would: from the
//! worker's last finished prefill (when what was sent before it was still all ahead, a
//! worker finishing in order) or the oldest outstanding send, adding each later send at
//! its time and draining at the rate in between.

use std::sync::Mutex;
use std::time::Instant;

/// One send's claim on a worker's prompt compute, to release when it is computed or
/// abandoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimId(u64);

/// A worker's outstanding prompt compute (see the module documentation).
#[derive(Debug, Default)]
pub(super) struct PromptBacklog {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Outstanding sends in the order they were made: (id, when, tokens).
    claims: Vec<(u64, Instant, u64)>,
    next_id: u64,
    /// When a send here was last reported computed.
    last_computed: Option<Instant>,
}

impl PromptBacklog {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes `tokens` sent at `at` to compute.
    pub(super) fn claim(&self, tokens: u64, at: Instant) -> ClaimId {
        let mut state = self.state();
        let id = state.next_id;
        state.next_id += 1;
        state.claims.push((id, at, tokens));
        ClaimId(id)
    }

    /// Ends claim `id`: computed at `at`, or abandoned (`None`: the request ended first).
    pub(super) fn release(&self, id: ClaimId, computed_at: Option<Instant>) {
        let mut state = self.state();
        state.claims.retain(|(claim, _, _)| *claim != id.0);
        if let Some(at) = computed_at {
            state.last_computed = Some(state.last_computed.map_or(at, |last| last.max(at)));
        }
    }

    /// Tokens outstanding.
    pub(super) fn pending(&self) -> u64 {
        self.state()
            .claims
            .iter()
            .map(|(_, _, tokens)| tokens)
            .sum()
    }

    /// Tokens still ahead at `now` for a worker computing `tokens_per_ms` (see the module
    /// documentation); the outstanding tokens where the rate is not a positive number.
    pub(super) fn ahead(&self, tokens_per_ms: f64, now: Instant) -> f64 {
        let state = self.state();
        let pending: u64 = state.claims.iter().map(|(_, _, tokens)| tokens).sum();
        if !(tokens_per_ms.is_finite() && tokens_per_ms > 0.0) {
            return pending as f64;
        }
        let Some(&(_, first, _)) = state.claims.first() else {
            return 0.0;
        };
        let anchor = state.last_computed.map_or(first, |last| last.max(first));
        let ms =
            |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
        let mut backlog = 0.0;
        let mut clock = anchor;
        for &(_, at, tokens) in &state.claims {
            if at > clock {
                backlog = (backlog - tokens_per_ms * ms(clock, at)).max(0.0);
                clock = at;
            }
            backlog += tokens as f64;
        }
        (backlog - tokens_per_ms * ms(clock, now)).max(0.0)
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
    fn work_drains_at_the_rate_from_the_last_finished_prefill() {
        let backlog = PromptBacklog::default();
        let t0 = Instant::now();
        let a = backlog.claim(2000, t0);
        let b = backlog.claim(2000, t0 + ms(10));
        assert_eq!(backlog.pending(), 4000);
        // 20 tokens per ms: 50 ms in, 1,000 of A's are done.
        assert!((backlog.ahead(20.0, t0 + ms(50)) - 3000.0).abs() < 1e-6);
        // Without a rate: all that is outstanding.
        assert_eq!(backlog.ahead(f64::NAN, t0 + ms(50)), 4000.0);
        // A finished at 100 ms: B was all still ahead then, and drains from there.
        backlog.release(a, Some(t0 + ms(100)));
        assert!((backlog.ahead(20.0, t0 + ms(110)) - 1800.0).abs() < 1e-6);
        // Sent after a gap in which the queue emptied: only its own work.
        let c = backlog.claim(500, t0 + ms(300));
        assert!((backlog.ahead(20.0, t0 + ms(310)) - 300.0).abs() < 1e-6);
        // Abandoned claims leave without moving the anchor; nothing left is nothing ahead.
        backlog.release(b, None);
        backlog.release(c, None);
        assert_eq!(backlog.pending(), 0);
        assert_eq!(backlog.ahead(20.0, t0 + ms(310)), 0.0);
    }
}
