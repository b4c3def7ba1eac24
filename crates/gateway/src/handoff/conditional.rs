//! Conditional disaggregation (`--disagg-threshold N`): a prompt whose uncached part is
//! shorter than N tokens is not worth a KV handoff; a decode worker prefills it itself.
//! With `--disagg-min-prefill-load L` that holds only while every prefill worker has L
//! prefill legs in flight: an idle prefill worker still takes short prompts.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use crate::fleet::registry::Roster;
use crate::policy::{RoutePrompt, RouteRequest};
use crate::serving::Serving;

/// Characters per token assumed when only prompt text is known (English BPE averages
/// about four; an estimate only decides whether a handoff pays, never correctness).
const CHARS_PER_TOKEN: usize = 4;

/// What a prompt would cost where: the tokens a decode worker would have to compute
/// itself, and those the best-placed prefill worker would.
struct Uncached {
    /// The whole prompt less the prefix the decode policy says a decode worker holds.
    on_decode: usize,
    /// The whole prompt less the prefix the prefill policy says a prefill worker holds.
    on_prefill: usize,
}

/// The prompt's uncached tokens on each side, as the policies' prefix state says. `None`
/// when the request has no prompt to measure.
fn uncached_tokens(
    state: &Arc<Serving>,
    roster: &Roster,
    route: &RouteRequest<'_>,
) -> Option<Uncached> {
    let prompt = route.prompt()?;
    let (len, per_token) = match &prompt {
        RoutePrompt::TokenIds(ids) => (ids.len(), 1),
        RoutePrompt::Text(text) => (text.chars().count(), CHARS_PER_TOKEN),
    };
    let uncached = |role: WorkerRole| {
        let cached = state
            .policy(role)
            .cached_prefix(role, roster.live(role), route)
            .map_or(0, |m| m.matched.min(len));
        (len - cached).div_ceil(per_token)
    };
    Some(Uncached {
        on_decode: uncached(WorkerRole::Decode),
        on_prefill: uncached(WorkerRole::Prefill),
    })
}

/// Whether a decode worker should compute the prompt: its part is under `threshold`,
/// and no more than a prefill worker would compute. A decode worker's prefill stalls the
/// streams it serves, so it never takes on a prefix a prefill worker already holds
/// (under the shared-prefix workload, `pdserve up --prefill 2` at c=8, 2026-12-06, that
/// took 1.97 req/s with inter-token p99 3.3 s, against 3.29 req/s and 236 ms with the
/// threshold off).
fn decode_should_compute(uncached: &Uncached, threshold: usize) -> bool {
    uncached.on_decode < threshold && uncached.on_decode <= uncached.on_prefill
}

/// Whether this request skips the prefill leg: its uncached part on a decode worker is
/// short and no longer than on a prefill worker, and (with
/// `--disagg-min-prefill-load`) no prefill worker in `roster` is idle enough to take it.
pub fn skips_prefill(state: &Arc<Serving>, roster: &Roster, route: &RouteRequest<'_>) -> bool {
    let Some(threshold) = state.settings.disagg_threshold else {
        return false;
    };
    if !prefill_pool_busy(roster, state.settings.disagg_min_prefill_load) {
        return false;
    }
    uncached_tokens(state, roster, route)
        .is_some_and(|uncached| decode_should_compute(&uncached, threshold))
}

/// Whether every live prefill worker has at least `min_load` prefill legs in flight.
fn prefill_pool_busy(roster: &Roster, min_load: u32) -> bool {
    if min_load == 0 {
        return true;
    }
    roster
        .live(WorkerRole::Prefill)
        .iter()
        .all(|worker| worker.in_flight() >= i64::from(min_load))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_worker_computes_short_prompts_but_never_a_prefix_a_prefill_worker_holds() {
        let at = |on_decode, on_prefill| Uncached {
            on_decode,
            on_prefill,
        };
        // Nothing cached anywhere (the README workload): short prompts stay on decode.
        assert!(decode_should_compute(&at(300, 300), 512));
        assert!(!decode_should_compute(&at(600, 600), 512));
        // The decode worker holds the prefix too: only the question is computed there.
        assert!(decode_should_compute(&at(48, 48), 512));
        // It holds less than a prefill worker does: the prefill worker computes less.
        assert!(!decode_should_compute(&at(300, 48), 512));
        // It holds more (a conversation's earlier turns): it computes less itself.
        assert!(decode_should_compute(&at(48, 800), 512));
    }
}
