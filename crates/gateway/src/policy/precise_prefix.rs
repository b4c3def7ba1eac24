//! `precise_prefix`: route on what the workers' own KV events say they cache. Each
//! candidate is scored by the tokens of this prompt its index holds (with the prompts
//! just sent it: [`EventMatcher`]), minus what its load costs (`--precise-load-cost`
//! prompt shares per queued request); the best score wins, then the lower load. Every
//! gateway replica reads the same events and the same worker load, so replicas choose
//! alike without sharing anything.
//!
//! Needs the prompt's token ids: token-id prompts, or any prompt with `--tokenizer`.
//! Without them, or when no candidate has a trusted index (none publishes events, or
//! every one is stale), the approximate prefix tree (`cache_aware`) decides.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use super::{
    CacheAware, CacheMatch, Choice, EventMatcher, MatchSource, Policy, PolicyStats, PrefixMatch,
    RequestOutcome, RoutePrompt, RouteRequest,
};
use crate::kv_events::KvEventsHub;
use crate::registry::Worker;

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
    fn standings(&self, candidates: &[Arc<Worker>], tokens: &[u32]) -> Option<Vec<Standing>> {
        let mut any_index = false;
        let standings = candidates
            .iter()
            .enumerate()
            .map(|(index, w)| {
                let held = self.matcher.held(w, tokens);
                any_index |= held.indexed;
                let load = w.load();
                let score = held.tokens as f64 - self.load_cost * load as f64 * tokens.len() as f64;
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
    /// first would pile every new prefix onto one worker).
    fn best(standings: &[Standing]) -> Standing {
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
        let standings = token_ids(request).and_then(|t| Some((t, self.standings(candidates, t)?)));
        let Some((tokens, standings)) = standings else {
            return self.fallback.choose(role, candidates, request);
        };
        let best = Self::best(&standings);
        let chosen = candidates[best.index].clone();
        self.matcher.sent(&chosen, tokens, best.cached);
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
        let Some(standings) = self.standings(candidates, tokens) else {
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

    fn retain_workers(&self, live: &[&str]) {
        self.fallback.retain_workers(live);
        self.matcher.retain_workers(live);
    }
}
