//! Conditional disaggregation (`--disagg-threshold N`): a prompt whose uncached part is
//! shorter than N tokens is not worth a KV handoff; a decode worker prefills it itself.
//! With `--disagg-min-prefill-load L` that holds only while every prefill worker has L
//! prefill legs in flight: an idle prefill worker still takes short prompts.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use crate::fleet::registry::{Roster, Worker};
use crate::policy::{RoutePrompt, RouteRequest};
use crate::serving::Serving;

/// Characters per token assumed when only prompt text is known (English BPE averages
/// about four; an estimate only decides whether a handoff pays, never correctness).
const CHARS_PER_TOKEN: usize = 4;

/// A decode worker that reports more of its KV cache held by running requests than this
/// (`vllm:kv_cache_usage_perc`, scraped with `--load-scrape-interval`) is given no
/// prompts to prefill. The prefix it holds lives in what is left, which the streams it
/// serves keep evicting, so the prompt it was sent for a short uncached part may have to
/// be computed whole, stalling those streams. Measured on `pdserve up --prefill 2`
/// under the shared-prefix workload (768-token system prompts, c=8, 2026-12-06):
/// without this check threshold 512 ran at 1.97 req/s with inter-token p99 3.3 s,
/// against 3.29 req/s and 236 ms with the threshold off.
const DECODE_KV_ROOM: f64 = 0.5;

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
    if !prefill_pool_busy(roster, state.settings.disagg_min_prefill_load)
        || !decode_has_room(roster.live(WorkerRole::Decode))
    {
        return false;
    }
    uncached_tokens(state, roster, route).is_some_and(|uncached| uncached < threshold)
}

/// Whether every decode worker that reports its KV cache use has room (see
/// [`DECODE_KV_ROOM`]); a worker without a fresh report does not object.
fn decode_has_room(decode: &[Arc<Worker>]) -> bool {
    decode.iter().all(|worker| {
        worker
            .reported_load()
            .and_then(|load| load.kv_usage)
            .is_none_or(|used| used <= DECODE_KV_ROOM)
    })
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
    use std::time::Duration;

    use super::*;
    use crate::policy::testing::workers;

    #[test]
    fn a_decode_worker_whose_kv_is_mostly_held_by_streams_prefills_nothing() {
        let decode = workers(WorkerRole::Decode, &[1, 2]);
        assert!(decode_has_room(&decode), "no reports: no objection");
        let fresh = Duration::from_secs(60);
        decode[0].report_load(0.0, 2.0, Some(0.3), None, fresh);
        decode[1].report_load(0.0, 1.0, None, None, fresh);
        assert!(decode_has_room(&decode));
        decode[1].report_load(0.0, 8.0, Some(0.8), None, fresh);
        assert!(!decode_has_room(&decode));
        decode[1].report_load(0.0, 8.0, Some(0.8), None, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(2));
        assert!(decode_has_room(&decode), "a stale report does not count");
    }
}
