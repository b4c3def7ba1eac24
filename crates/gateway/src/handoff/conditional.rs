//! Conditional disaggregation (`--disagg-threshold N`): a prompt whose uncached part is
//! shorter than N tokens is not worth a KV handoff; a decode worker prefills it itself.
//! With `--disagg-min-prefill-load L` that holds only while every prefill worker has L
//! prefill legs in flight: an idle prefill worker still takes short prompts. At most one
//! such prompt per live decode worker is in its prefill at a time ([`LocalPrefill`]).
//!
//! For a request with objectives (`x-slo-*`, `--slo-*`) under `--policy slo`, the latency
//! predictors decide first: a prompt is prefilled on the decode worker when the route
//! through the prefill pool is predicted to miss its objectives and the decode worker
//! alone to meet them, and handed off when it is the other way round; the size rule
//! decides the rest.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use crate::fleet::registry::Roster;
use crate::policy::{RoutePrompt, RouteRequest};
use crate::serving::outlook::Outlook;
use crate::serving::Serving;

/// Characters per token assumed when only prompt text is known (English BPE averages
/// about four; an estimate only decides whether a handoff pays, never correctness).
const CHARS_PER_TOKEN: usize = 4;

/// The prompt's tokens that a decode worker would have to compute itself: the whole
/// prompt, less the prefix the decode policy's prefix tree says a decode worker already
/// holds. `None` when the request has no prompt to measure.
fn uncached_tokens(
    state: &Arc<Serving>,
    roster: &Roster,
    route: &RouteRequest<'_>,
) -> Option<usize> {
    let prompt = route.prompt()?;
    let (len, per_token) = match &prompt {
        RoutePrompt::TokenIds(ids) => (ids.len(), 1),
        RoutePrompt::Text(text) => (text.chars().count(), CHARS_PER_TOKEN),
    };
    let decode = roster.live(WorkerRole::Decode);
    let cached = state
        .policy(WorkerRole::Decode)
        .cached_prefix(WorkerRole::Decode, decode, route)
        .map_or(0, |m| m.matched.min(len));
    Some((len - cached).div_ceil(per_token))
}

/// A prompt a decode worker prefills itself, counted until dropped (when the decode
/// worker's answer has started, so its prefill is done).
///
/// A decode worker computes such a prompt between the steps of the streams it serves,
/// which wait for it; two or more at once add up. Under the shared-prefix workload
/// (`pdserve up --prefill 2`, c=8, four seeds, docs/benchmarks.md) one at a time held
/// inter-token p99 to 205–243 ms in three runs of four, against 281–963 ms unbounded.
#[derive(Debug)]
pub struct LocalPrefill(Arc<AtomicUsize>);

impl Drop for LocalPrefill {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether this request skips the prefill leg: its uncached part is short, (with
/// `--disagg-min-prefill-load`) no prefill worker in `roster` is idle enough to take it,
/// and fewer prompts than there are live decode workers are being prefilled on one. The
/// returned turn is held until the decode worker's answer starts.
pub fn skips_prefill(
    state: &Arc<Serving>,
    roster: &Roster,
    route: &RouteRequest<'_>,
) -> Option<LocalPrefill> {
    let threshold = state.settings.disagg_threshold?;
    let by_size = || {
        prefill_pool_busy(roster, state.settings.disagg_min_prefill_load)
            && uncached_tokens(state, roster, route).is_some_and(|uncached| uncached < threshold)
    };
    if !predicted_choice(state, roster, route).unwrap_or_else(by_size) {
        return None;
    }
    take_turn(&state.local_prefills, roster.live(WorkerRole::Decode).len())
}

/// What the latency predictors say, for a request with objectives where both routes are
/// predicted: prefill on the decode worker when the route through the prefill pool is
/// predicted to miss the objectives and the decode worker alone to meet them (its TPOT
/// included); keep the handoff when it is the other way round. `None` (the size rule
/// decides) when both or neither meet them, or nothing is predicted.
fn predicted_choice(state: &Serving, roster: &Roster, route: &RouteRequest<'_>) -> Option<bool> {
    if route.slo.ttft.is_none() && route.slo.tpot.is_none() {
        return None;
    }
    let outlook = Outlook::of(state, roster, route);
    let (through_prefill, local) = (outlook.disaggregated?, outlook.local?);
    match (through_prefill.meets(route.slo), local.meets(route.slo)) {
        (false, true) => Some(true),
        (true, false) => Some(false),
        _ => None,
    }
}

/// One of `slots` turns at a local prefill, if one is free.
fn take_turn(counter: &Arc<AtomicUsize>, slots: usize) -> Option<LocalPrefill> {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < slots).then_some(n + 1)
        })
        .ok()?;
    Some(LocalPrefill(counter.clone()))
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
    fn one_local_prefill_per_decode_worker_at_a_time() {
        let counter = Arc::new(AtomicUsize::new(0));
        let first = take_turn(&counter, 2).expect("a free turn");
        let second = take_turn(&counter, 2).expect("a second decode worker's turn");
        assert!(
            take_turn(&counter, 2).is_none(),
            "both decode workers are prefilling"
        );
        drop(first);
        let third = take_turn(&counter, 2).expect("a turn freed by an answer that started");
        assert!(
            take_turn(&counter, 0).is_none(),
            "no decode worker: no turn"
        );
        drop((second, third));
        assert_eq!(counter.load(Ordering::SeqCst), 0);
    }
}
