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

/// Whether this request skips the prefill leg: its uncached part is short, and (with
/// `--disagg-min-prefill-load`) no prefill worker in `roster` is idle enough to take it.
pub fn skips_prefill(state: &Arc<Serving>, roster: &Roster, route: &RouteRequest<'_>) -> bool {
    let Some(threshold) = state.settings.disagg_threshold else {
        return false;
    };
    if !prefill_pool_busy(roster, state.settings.disagg_min_prefill_load) {
        return false;
    }
    uncached_tokens(state, roster, route).is_some_and(|uncached| uncached < threshold)
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
