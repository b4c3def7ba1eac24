//! `precise_prefix`: route on what the workers' own KV events say they cache. Each
//! candidate is scored by the tokens of this prompt its index holds, minus what its load
//! costs (`--precise-load-cost` prompt shares per queued request); the best score wins,
//! then the lower load. Every gateway replica reads the same events and the same worker
//! load, so replicas choose alike without sharing anything.
//!
//! Events arrive once a worker has computed a prompt; until then the prompts this
//! gateway just sent a worker count as held there too (for `PENDING_FOR`), or every
//! request of a new shared prefix that arrives at once would find it nowhere and spread,
//! each worker computing it again.
//!
//! Needs the prompt's token ids: token-id prompts, or any prompt with `--tokenizer`.
//! Without them, or when no candidate publishes events, the approximate prefix tree
//! (`cache_aware`) decides.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;
use pdserve_protocol::WorkerRole;

use super::{
    CacheAware, Policy, PolicyStats, PrefixMatch, RequestOutcome, RoutePrompt, RouteRequest,
};
use crate::kv_events::{prompt_keys, BlockKey, KvEventsHub};
use crate::registry::Worker;

/// How long a prompt sent to a worker counts as cached there before its events say so.
const PENDING_FOR: Duration = Duration::from_secs(10);
/// Blocks remembered as pending per worker.
const PENDING_BLOCKS: usize = 65_536;
/// The block size pending prompts are cut into before a worker's events have said its
/// own (vLLM's and pdserve's default).
const PROVISIONAL_BLOCK_SIZE: usize = 16;

/// Routes on the workers' KV-event indexes.
#[derive(Debug)]
pub struct PrecisePrefix {
    hub: Arc<KvEventsHub>,
    fallback: CacheAware,
    load_cost: f64,
    /// Blocks of prompts recently sent to each worker, with when.
    pending: Mutex<HashMap<String, LruCache<BlockKey, Instant>>>,
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
            pending: Mutex::default(),
        }
    }

    /// `worker`'s block size as its events say, else the provisional one.
    fn block_size(&self, worker: &str) -> usize {
        self.hub
            .worker(worker)
            .and_then(|e| e.lock().block_size())
            .map_or(PROVISIONAL_BLOCK_SIZE, |b| b as usize)
    }

    /// Tokens of `tokens` from the start that this gateway sent `worker` within
    /// `PENDING_FOR`, in whole blocks of `block_size`.
    fn pending_tokens(&self, worker: &str, tokens: &[u32], block_size: usize) -> usize {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(blocks) = pending.get_mut(worker) else {
            return 0;
        };
        let fresh = |at: &Instant| at.elapsed() < PENDING_FOR;
        prompt_keys(tokens, block_size)
            .iter()
            .take_while(|key| blocks.get(*key).is_some_and(fresh))
            .count()
            * block_size
    }

    /// Remembers that `tokens` went to `worker`.
    fn sent(&self, worker: &str, tokens: &[u32], block_size: usize) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let blocks = pending
            .entry(worker.to_string())
            .or_insert_with(|| LruCache::new(NonZeroUsize::new(PENDING_BLOCKS).expect("non-zero")));
        let now = Instant::now();
        for key in prompt_keys(tokens, block_size) {
            blocks.put(key, now);
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
                let events = self.hub.worker(&w.base);
                any_index |= events.is_some();
                let block_size = self.block_size(&w.base);
                let cached = events.and_then(|e| e.cached_tokens(tokens)).unwrap_or(0);
                let pending = self.pending_tokens(&w.base, tokens, block_size);
                let cached = cached.max(pending);
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
        if candidates.is_empty() {
            return None;
        }
        let standings = token_ids(request).and_then(|t| Some((t, self.standings(candidates, t)?)));
        let Some((tokens, standings)) = standings else {
            return self.fallback.select(role, candidates, request);
        };
        let best = Self::best(&standings);
        let chosen = candidates[best.index].clone();
        self.sent(&chosen.base, tokens, self.block_size(&chosen.base));
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
