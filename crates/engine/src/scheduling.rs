//! The order in which the scheduler hands out each step's token budget.

use std::cmp::Ordering;
use std::time::{Duration, Instant};

use crate::sequence::Sequence;

/// Which sequences get a step's token budget first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// Running sequences in admission order, then waiting ones in arrival order.
    Fcfs,
    /// The sequence with the fewest prompt tokens left to compute first (decode tokens
    /// count as one), waiting prompts included: a short prompt that arrives while a long
    /// one is being prefilled gets its first token after its own compute, not after the
    /// long prompt's. A sequence that arrived more than `age_limit` ago goes before every
    /// younger one (oldest first), so long prompts are delayed, never starved.
    ShortestPrefillFirst {
        /// How long a sequence can be passed over.
        age_limit: Duration,
    },
    /// vLLM's priority scheduling: the request's `priority` (lower first), then arrival,
    /// running and waiting sequences alike; a waiting request goes before running ones of
    /// a later class, and blocks run short the latest-class running sequence is preempted.
    Priority,
}

/// Where a sequence stands under [`SchedulingPolicy::ShortestPrefillFirst`]; smaller goes
/// first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Priority {
    /// Past the age limit: ordered by arrival only, ahead of everything younger.
    aged: bool,
    /// The request's `priority` under [`SchedulingPolicy::Priority`] (else 0).
    class: i64,
    /// Prompt tokens still to compute (1 for a decoding sequence).
    remaining: usize,
    arrived: Instant,
}

impl Ord for Priority {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self.aged, other.aged) {
            (true, true) => self.arrived.cmp(&other.arrived),
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => self
                .class
                .cmp(&other.class)
                .then(self.remaining.cmp(&other.remaining))
                .then(self.arrived.cmp(&other.arrived)),
        }
    }
}

impl PartialOrd for Priority {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl SchedulingPolicy {
    /// The age limit when the policy orders by remaining prompt tokens.
    fn age_limit(self) -> Option<Duration> {
        match self {
            Self::ShortestPrefillFirst { age_limit } => Some(age_limit),
            Self::Fcfs | Self::Priority => None,
        }
    }

    /// Whether this policy reorders sequences (and lets waiting prompts go before
    /// running ones).
    pub(crate) fn reorders(self) -> bool {
        self != Self::Fcfs
    }

    /// Whether requests' `priority` is honoured (else a non-zero one is refused).
    pub fn honours_priority(self) -> bool {
        self == Self::Priority
    }

    /// A running sequence's priority (tokens left to compute).
    pub(crate) fn running(self, seq: &Sequence, now: Instant) -> Priority {
        self.ranked(seq, seq.num_uncomputed(), now)
    }

    /// A waiting sequence's priority: its tokens less those a peer's KV will supply (a
    /// prefix-cache hit is only known at admission).
    pub(crate) fn waiting(self, seq: &Sequence, now: Instant) -> Priority {
        let imported = seq.kv_import().map_or(0, |import| import.num_tokens);
        let remaining = seq.tokens.len() - seq.num_computed.max(imported).min(seq.tokens.len());
        self.ranked(seq, remaining.max(1), now)
    }

    /// `seq`'s priority with `remaining` tokens to compute.
    fn ranked(self, seq: &Sequence, remaining: usize, now: Instant) -> Priority {
        match self {
            // Class, then arrival: the work left does not count.
            Self::Priority => Priority {
                aged: false,
                class: seq.priority(),
                remaining: 0,
                arrived: seq.arrived,
            },
            _ => self.priority(remaining, seq.arrived, now),
        }
    }

    fn priority(self, remaining: usize, arrived: Instant, now: Instant) -> Priority {
        let aged = self
            .age_limit()
            .is_some_and(|limit| now.saturating_duration_since(arrived) > limit);
        Priority {
            aged,
            class: 0,
            remaining,
            arrived,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorter_goes_first_until_the_age_limit() {
        let policy = SchedulingPolicy::ShortestPrefillFirst {
            age_limit: Duration::from_secs(10),
        };
        let now = Instant::now() + Duration::from_secs(60);
        let old = now - Duration::from_secs(11);
        let older = now - Duration::from_secs(30);
        let young = now - Duration::from_secs(1);
        let long_young = policy.priority(700, young, now);
        let short_young = policy.priority(50, young, now);
        let long_old = policy.priority(700, old, now);
        let long_older = policy.priority(900, older, now);
        assert!(short_young < long_young);
        assert!(
            long_old < short_young,
            "past the age limit a prompt goes first"
        );
        assert!(long_older < long_old, "aged ones go in arrival order");
        let tie_early = policy.priority(50, older, older + Duration::from_secs(1));
        let tie_late = policy.priority(50, young, older + Duration::from_secs(1));
        assert!(tie_early < tie_late, "equal work goes in arrival order");
        assert!(!SchedulingPolicy::Fcfs.reorders());
        assert!(policy.reorders());
    }
}
