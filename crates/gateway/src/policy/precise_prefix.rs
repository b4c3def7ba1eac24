//! `precise_prefix`: route on what the workers' own KV events say they cache. Each
//! candidate is scored by the tokens of this prompt its index holds, minus what its load
//! costs (`--precise-load-cost` prompt shares per queued request); the best score wins,
//! then the lower load. Every gateway replica reads the same events and the same worker
//! load, so replicas choose alike without sharing anything.
//!
//! Needs the prompt's token ids: token-id prompts, or any prompt with `--tokenizer`.
//! Without them, or when no candidate publishes events, the approximate prefix tree
//! (`cache_aware`) decides.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use super::{
    CacheAware, Policy, PolicyStats, PrefixMatch, RequestOutcome, RoutePrompt, RouteRequest,
};
use crate::kv_events::KvEventsHub;
use crate::registry::Worker;

/// Routes on the workers' KV-event indexes.
#[derive(Debug)]
pub struct PrecisePrefix {
    hub: Arc<KvEventsHub>,
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
            hub,
            fallback,
            load_cost,
        }
    }

    /// Every candidate's standing, when the prompt has token ids and some candidate
    /// publishes events; `None` otherwise.
    fn standings(&self, candidates: &[Arc<Worker>], tokens: &[u32]) -> Option<Vec<Standing>> {
        let mut any_index = false;
        let standings = candidates
            .iter()
            .enumerate()
            .map(|(index, w)| {
                let cached = self
                    .hub
                    .worker(&w.base)
                    .and_then(|events| events.cached_tokens(tokens));
                any_index |= cached.is_some();
                let cached = cached.unwrap_or(0);
                let load = w.load();
                let score = cached as f64 - self.load_cost * load as f64 * tokens.len() as f64;
                Standing {
                    index,
                    cached,
                    load,
                    score,
                }
            })
            .collect();
        any_index.then_some(standings)
    }

    fn best(standings: &[Standing]) -> Standing {
        *standings
            .iter()
            .reduce(|best, s| {
                if s.score > best.score || (s.score == best.score && s.load < best.load) {
                    s
                } else {
                    best
                }
            })
            .expect("candidates are not empty")
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
        if candidates.is_empty() {
            return None;
        }
        let standings = token_ids(request).and_then(|t| Some((t, self.standings(candidates, t)?)));
        let Some((tokens, standings)) = standings else {
            return self.fallback.select(role, candidates, request);
        };
        let best = Self::best(&standings);
        let chosen = candidates[best.index].clone();
        tracing::debug!(
            %role,
            worker = %chosen.base,
            cached_tokens = best.cached,
            prompt_tokens = tokens.len(),
            load = best.load,
            "precise_prefix: the worker whose events hold the most of this prompt, net of load"
        );
        Some(chosen)
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
        let standings = self.standings(candidates, tokens)?;
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

    fn stats(&self) -> PolicyStats {
        self.fallback.stats()
    }

    fn retain_workers(&self, live: &[&str]) {
        self.fallback.retain_workers(live);
    }
}
