//! `precise_prefix`: route on what the workers' own KV events say they cache. Each
//! candidate is scored by the tokens of this prompt its index holds (with the prompts
//! just sent it: [`EventMatcher`]), minus what its load costs (`--precise-load-cost`
//! prompt shares per queued request); the best score wins, then the lower load. Every
//! gateway replica reads the same events and the same worker load, so replicas choose
//! alike without sharing anything.
//!
//! A prompt every candidate holds equally much of (a new prefix after, say, a common
//! system prompt) goes, among the candidates within
//! `NEW_PREFIX_LOAD_SLACK` of the least load, to the one its first tokens hash highest
//! with (rendezvous hashing): replicas that each see half the traffic, and none of the
//! other's just-sent prompts, still send a new prefix's first requests to the same worker
//! instead of each computing it on another.
//!
//! Needs the prompt's token ids: token-id prompts, or any prompt with `--tokenizer`.
//! Without them, or when no candidate has a trusted index (none publishes events, or
//! every one is stale), the approximate prefix tree (`cache_aware`) decides.

use std::sync::Arc;

use pdserve_protocol::session::{rendezvous_key, rendezvous_score_of_id};
use pdserve_protocol::WorkerRole;

use super::{
    CacheAware, CacheMatch, Choice, EventMatcher, MatchSource, Policy, PolicyStats, PrefixMatch,
    RequestOutcome, RoutePrompt, RouteRequest,
};
use crate::fleet::kv_events::{KvEventsHub, PromptKeys};
use crate::fleet::registry::Worker;

/// Tokens of a prompt's start that name its prefix for rendezvous hashing: enough to tell
/// shared system prompts apart, few enough that prompts sharing one agree.
const AFFINITY_TOKENS: usize = 128;

/// Requests more than the least loaded candidate that a worker may have and still take a
/// new prefix by its hash: replicas' views of load differ by their own recent sends.
const NEW_PREFIX_LOAD_SLACK: i64 = 2;

/// Routes on the workers' KV-event indexes.
#[derive(Debug)]
pub struct PrecisePrefix {
    matcher: EventMatcher,
    fallback: CacheAware,
    load_cost: f64,
}

/// One candidate's standing for a prompt.
#[derive(Debug, Clone, Copy)]
struct Standing {
    index: usize,
    cached: usize,
    load: i64,
    score: f64,
}

impl PrecisePrefix {
    /// A policy over `hub`'s indexes, with `fallback` for prompts and pools without events.
    pub fn new(hub: Arc<KvEventsHub>, fallback: CacheAware, load_cost: f64) -> Self {
        Self {
            matcher: EventMatcher::new(hub),
            fallback,
            load_cost,
        }
    }

    /// Every candidate's standing, when some candidate has a trusted index; `None`
    /// otherwise.
    fn standings(
        &self,
        candidates: &[Arc<Worker>],
        keys: &mut PromptKeys<'_>,
    ) -> Option<Vec<Standing>> {
        let prompt_len = keys.tokens().len() as f64;
        let held = self.matcher.held_by_each(candidates, keys);
        let any_index = held.iter().any(|h| h.indexed);
        let now = std::time::Instant::now();
        let standings = candidates
            .iter()
            .zip(held)
            .enumerate()
            .map(|(index, (w, held))| {
                let load = w.load_at(now);
                let score = held.tokens as f64 - self.load_cost * load as f64 * prompt_len;
                Standing {
                    index,
                    cached: held.tokens,
                    load,
                    score,
                }
            })
            .collect();
        any_index.then_some(standings)
    }

    /// The best score, then the lower load; among equals, one at random (always the
    /// first would pile every new prefix onto one worker). A prompt every candidate
    /// holds equally much of goes by [`new_prefix_choice`] instead.
    fn best(standings: &[Standing], candidates: &[Arc<Worker>], tokens: &[u32]) -> Standing {
        let common = standings[0].cached;
        if standings.iter().all(|s| s.cached == common) {
            return new_prefix_choice(standings, candidates, &tokens[common.min(tokens.len())..]);
        }
        let top = standings.iter().map(|s| (s.score, -s.load)).fold(
            (f64::NEG_INFINITY, i64::MIN),
            |a, b| if b > a { b } else { a },
        );
        let equal: Vec<&Standing> = standings
            .iter()
            .filter(|s| (s.score, -s.load) == top)
            .collect();
        *equal[rand::Rng::random_range(&mut rand::rng(), 0..equal.len())]
    }
}

/// For a prompt whose `new` part (after what every candidate holds) no candidate holds:
/// among the candidates within `NEW_PREFIX_LOAD_SLACK` of the least load, the one whose
/// URL's id hashes highest with the first `AFFINITY_TOKENS` tokens of `new`. Every replica
/// computes the same hashes (the protocol's fixed rendezvous hash over fixed-seed URL
/// ids), so they agree while their views of load roughly do.
fn new_prefix_choice(standings: &[Standing], candidates: &[Arc<Worker>], new: &[u32]) -> Standing {
    let least = standings.iter().map(|s| s.load).min().unwrap_or(0);
    let start = &new[..new.len().min(AFFINITY_TOKENS)];
    // One key for the prompt, scored against each candidate's URL.
    let key: Vec<u8> = start.iter().flat_map(|t| t.to_le_bytes()).collect();
    let key = rendezvous_key(&key);
    *standings
        .iter()
        .filter(|s| s.load <= least.saturating_add(NEW_PREFIX_LOAD_SLACK))
        .max_by_key(|s| rendezvous_score_of_id(key, candidates[s.index].id()))
        .expect("the least loaded candidate is within the slack")
}

impl PrecisePrefix {
    /// The tokens of `tokens` each of `candidates` holds, when some candidate has a
    /// trusted index (the `slo` policy weighs them with its predictions).
    pub(crate) fn held_by_each(
        &self,
        candidates: &[Arc<Worker>],
        tokens: &[u32],
    ) -> Option<Vec<usize>> {
        let mut keys = PromptKeys::new(tokens);
        let held = self.matcher.held_by_each(candidates, &mut keys);
        held.iter()
            .any(|h| h.indexed)
            .then(|| held.iter().map(|h| h.tokens).collect())
    }

    /// Notes that `tokens` went to `worker`, which held `held` of them.
    pub(crate) fn note_sent(&self, worker: &Worker, tokens: &[u32], held: usize) {
        self.matcher
            .sent(worker, &mut PromptKeys::new(tokens), held);
    }
}

fn token_ids<'a>(request: &RouteRequest<'a>) -> Option<&'a [u32]> {
    match request.prompt()? {
        RoutePrompt::TokenIds(ids) if !ids.is_empty() => Some(ids),
        _ => None,
    }
}

impl Policy for PrecisePrefix {
    fn name(&self) -> &'static str {
        "precise_prefix"
    }

    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        self.choose(role, candidates, request).map(|c| c.worker)
    }

    fn choose(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Choice> {
        if candidates.is_empty() {
            return None;
        }
        let Some(tokens) = token_ids(request) else {
            return self.fallback.choose(role, candidates, request);
        };
        let mut keys = PromptKeys::new(tokens);
        let Some(standings) = self.standings(candidates, &mut keys) else {
            return self.fallback.choose(role, candidates, request);
        };
        let best = Self::best(&standings, candidates, tokens);
        let chosen = candidates[best.index].clone();
        self.matcher.sent(&chosen, &mut keys, best.cached);
        tracing::debug!(
            %role,
            worker = %chosen.base,
            cached_tokens = best.cached,
            prompt_tokens = tokens.len(),
            load = best.load,
            "precise_prefix: the worker whose events hold the most of this prompt, net of load"
        );
        Some(Choice {
            worker: chosen,
            cache: Some(CacheMatch {
                source: MatchSource::Events,
                matched: best.cached,
                prompt_len: tokens.len(),
                tokens: true,
            }),
            forecast: None,
        })
    }

    fn on_request_end(&self, worker: &Worker, outcome: RequestOutcome) {
        self.fallback.on_request_end(worker, outcome);
    }

    fn cached_prefix(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<PrefixMatch> {
        let Some(tokens) = token_ids(request) else {
            return self.fallback.cached_prefix(role, candidates, request);
        };
        let Some(standings) = self.standings(candidates, &mut PromptKeys::new(tokens)) else {
            return self.fallback.cached_prefix(role, candidates, request);
        };
        let best = standings.iter().max_by_key(|s| s.cached)?;
        (best.cached > 0).then(|| PrefixMatch {
            worker: candidates[best.index].clone(),
            matched: best.cached,
            prompt_len: tokens.len(),
        })
    }

    fn tree_size(&self) -> usize {
        self.fallback.tree_size()
    }

    fn reads_prompt(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        self.fallback.stats()
    }

    fn forget_sent(&self, worker: &Worker, tokens: &[u32]) {
        self.fallback.forget_sent(worker, tokens);
        self.matcher.unsent(worker, &mut PromptKeys::new(tokens));
    }

    fn retain_workers(&self, live: &[&str]) {
        self.fallback.retain_workers(live);
        self.matcher.retain_workers(live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::workers;

    fn standing(index: usize, cached: usize, load: i64) -> Standing {
        Standing {
            index,
            cached,
            load,
            score: cached as f64 - 0.1 * load as f64 * 300.0,
        }
    }

    fn prompt(seed: u32) -> Vec<u32> {
        (0..300)
            .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
            .collect()
    }

    #[test]
    fn replicas_send_a_new_prefix_to_the_same_worker_and_new_prefixes_spread() {
        let pool = workers(WorkerRole::Prefill, &[9001, 9002]);
        let mut on_first = 0;
        for seed in 0..64 {
            let tokens = prompt(seed);
            // Two replicas whose views of load differ by their own recent sends.
            let one = [standing(0, 0, 1), standing(1, 0, 0)];
            let two = [standing(0, 0, 0), standing(1, 0, 2)];
            let a = PrecisePrefix::best(&one, &pool, &tokens).index;
            let b = PrecisePrefix::best(&two, &pool, &tokens).index;
            assert_eq!(a, b, "prompt {seed}");
            // Only the prompt's start names it.
            let mut longer = tokens.clone();
            longer.extend([1, 2, 3]);
            assert_eq!(PrecisePrefix::best(&one, &pool, &longer).index, a);
            on_first += usize::from(a == 0);
        }
        assert!(
            (16..=48).contains(&on_first),
            "{on_first} of 64 on the first"
        );
    }

    #[test]
    fn a_new_prefix_keeps_off_a_worker_past_the_slack_and_after_a_common_prefix() {
        let pool = workers(WorkerRole::Prefill, &[9001, 9002]);
        for seed in 0..32 {
            let tokens = prompt(seed);
            let busy = [standing(0, 0, 0), standing(1, 0, NEW_PREFIX_LOAD_SLACK + 1)];
            assert_eq!(PrecisePrefix::best(&busy, &pool, &tokens).index, 0);
            // Both hold the same 32-token system prompt: what follows it names the prefix,
            // so prompts after one common system prompt still spread.
            let common = [standing(0, 32, 0), standing(1, 32, 0)];
            let fresh = [standing(0, 0, 0), standing(1, 0, 0)];
            assert_eq!(
                PrecisePrefix::best(&common, &pool, &tokens).index,
                PrecisePrefix::best(&fresh, &pool, &tokens[32..]).index
            );
        }
        // Whoever holds more of the prompt still wins.
        let tokens = prompt(1);
        let held = [standing(0, 0, 0), standing(1, 256, 0)];
        assert_eq!(PrecisePrefix::best(&held, &pool, &tokens).index, 1);
    }
}
