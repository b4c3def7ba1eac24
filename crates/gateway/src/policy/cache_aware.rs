//! Cache-aware: send a prompt where its prefix is most likely cached, unless load is
//! imbalanced.
//!
//! The policy keeps an approximate prefix tree of the prompts it sent to each worker,
//! per role (prompt bytes for text, token ids for token prompts). For each request:
//!
//! 1. Load is imbalanced when max − min in-flight > `balance_abs_threshold` and
//!    max > min × `balance_rel_threshold` (SGLang's test): route to the least-loaded
//!    candidate.
//! 2. Otherwise the candidate with the longest match wins when match / prompt length
//!    (both in bytes, or tokens) > `cache_threshold`, unless its extra in-flight requests
//!    cost more than the cached tokens it has over the least-loaded candidate
//!    ([`queue_outweighs_cache`]): then the least-loaded one.
//! 3. Otherwise the least-loaded candidate, ties to the smallest tree. SGLang goes to the
//!    smallest tree alone; putting load first keeps a burst of new prefixes from piling
//!    onto one worker while in-flight counts still look balanced, and at equal load the
//!    smaller tree still spreads new prefixes like SGLang does.
//!
//! The prompt is recorded under the chosen worker at selection time. Each tree is capped
//! at `max_tree_size` approximate bytes with inline LRU eviction ([`PrefixTree`]).
//! Workers that leave the roster are never candidates, so their trees stop mattering at
//! once; trees of workers that have not been a candidate for [`IDLE_PRUNE_SECS`] are
//! dropped (checked at most once a minute on the request path), and
//! [`Policy::retain_workers`] drops them at a roster change.
//!
//! `--cache-source` says where a worker's match comes from when the prompt has token ids
//! (a token-id prompt, or any prompt with `--tokenizer`): `approximate`, the tree alone;
//! `events`, the worker's own KV events ([`EventMatcher`]; a worker without a trusted
//! index holds only what was just sent it); `auto` (the default), events where the worker
//! publishes them and the tree elsewhere. The tree is kept in every mode, so a worker
//! whose stream goes stale falls back to it at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use pdserve_protocol::WorkerRole;

use super::prefix_tree::PrefixTree;
use super::{
    role_index, CacheMatch, Choice, EventMatcher, MatchSource, Policy, PolicyConfig, PolicyStats,
    PrefixMatch, RoutePrompt, RouteRequest,
};
use crate::fleet::kv_events::{KvEventsHub, PromptKeys};
use crate::fleet::registry::Worker;

/// Where `cache_aware` reads a worker's match from (`--cache-source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CacheSource {
    /// The worker's KV events where it publishes them, the approximate tree elsewhere.
    #[default]
    Auto,
    /// The workers' KV events only.
    Events,
    /// The gateway's approximate tree of what it sent each worker.
    Approximate,
}

/// A worker's trees are dropped once it has not been a candidate for this long.
pub const IDLE_PRUNE_SECS: u64 = 600;
/// How often (at most) the request path looks for idle trees.
const PRUNE_CHECK_SECS: u64 = 60;

/// Routes on prefix affinity with a load-balance override (see the module docs).
#[derive(Debug)]
pub struct CacheAware {
    cache_threshold: f64,
    queue_cost: f64,
    balance_abs_threshold: usize,
    balance_rel_threshold: f64,
    max_tree_size: usize,
    source: CacheSource,
    /// The workers' event indexes (none: every match is approximate).
    events: Option<EventMatcher>,
    /// Per role, each worker's trees by base URL.
    roles: [RwLock<HashMap<String, Entry>>; 4],
    epoch: Instant,
    last_prune: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    imbalanced: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    trees: Mutex<Trees>,
    /// Seconds since the policy's epoch when the worker was last a candidate.
    seen: AtomicU64,
}

#[derive(Debug)]
struct Trees {
    text: PrefixTree<u8>,
    tokens: PrefixTree<u32>,
}

/// A prompt as tree symbols.
#[derive(Debug, Clone, Copy)]
enum Key<'a> {
    Text(&'a [u8]),
    Tokens(&'a [u32]),
}

impl<'a> Key<'a> {
    fn of(prompt: &'a RoutePrompt<'_>) -> Self {
        match prompt {
            RoutePrompt::Text(text) => Key::Text(text.as_bytes()),
            RoutePrompt::TokenIds(ids) => Key::Tokens(ids),
        }
    }

    fn len(self) -> usize {
        match self {
            Key::Text(t) => t.len(),
            Key::Tokens(t) => t.len(),
        }
    }
}

impl Trees {
    fn match_len(&self, key: Key<'_>) -> usize {
        match key {
            Key::Text(t) => self.text.match_len(t),
            Key::Tokens(t) => self.tokens.match_len(t),
        }
    }

    /// The size of the tree `key` would go into (or of both without a key).
    fn size_for(&self, key: Option<Key<'_>>) -> usize {
        match key {
            Some(Key::Text(_)) => self.text.size(),
            Some(Key::Tokens(_)) => self.tokens.size(),
            None => self.text.size() + self.tokens.size(),
        }
    }

    fn insert(&mut self, key: Key<'_>) {
        match key {
            Key::Text(t) => self.text.insert(t),
            Key::Tokens(t) => self.tokens.insert(t),
        }
    }
}

/// What one pass over the candidates found.
struct Scan {
    /// Index and match length of the longest match (ties: less loaded, smaller tree).
    best: usize,
    best_len: usize,
    /// Index of the least-loaded candidate (ties: smaller tree), and its match length.
    lowest: usize,
    lowest_len: usize,
    /// Per candidate, whether its match came from its events.
    from_events: Vec<bool>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere must not take routing down; the trees stay structurally valid
    // between operations.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CacheAware {
    /// A cache-aware policy tuned by `config`, on its approximate trees alone.
    pub fn new(config: &PolicyConfig) -> Self {
        Self::build(config, None)
    }

    /// A cache-aware policy tuned by `config`, reading `hub`'s event indexes as its
    /// `cache_source` says.
    pub fn with_events(config: &PolicyConfig, hub: &Arc<KvEventsHub>) -> Self {
        let events = (config.cache_source != CacheSource::Approximate)
            .then(|| EventMatcher::new(hub.clone()));
        Self::build(config, events)
    }

    fn build(config: &PolicyConfig, events: Option<EventMatcher>) -> Self {
        Self {
            cache_threshold: config.cache_threshold,
            queue_cost: config.queue_cost,
            balance_abs_threshold: config.balance_abs_threshold,
            balance_rel_threshold: config.balance_rel_threshold,
            max_tree_size: config.max_tree_size,
            source: if events.is_some() {
                config.cache_source
            } else {
                CacheSource::Approximate
            },
            events,
            roles: Default::default(),
            epoch: Instant::now(),
            last_prune: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            imbalanced: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_secs()
    }

    /// SGLang's imbalance test over the candidates' loads (reported by the workers, else
    /// this gateway's in-flight counts).
    fn is_imbalanced(&self, candidates: &[Arc<Worker>]) -> bool {
        let (mut min, mut max) = (i64::MAX, i64::MIN);
        for w in candidates {
            let load = w.load();
            min = min.min(load);
            max = max.max(load);
        }
        let (min, max) = (min.max(0) as u64, max.max(0) as u64);
        max - min > self.balance_abs_threshold as u64
            && max as f64 > min as f64 * self.balance_rel_threshold
    }

    /// What `worker` holds of `tokens` by its events, when the cache source reads them
    /// for this worker.
    fn event_match(&self, worker: &Worker, keys: &mut PromptKeys<'_>) -> Option<usize> {
        let held = self.events.as_ref()?.held(worker, keys);
        match self.source {
            CacheSource::Events => Some(held.tokens),
            CacheSource::Auto if held.indexed => Some(held.tokens),
            _ => None,
        }
    }

    /// Matches `key` (when given) against every candidate's events or tree;
    /// `candidates` is not empty.
    fn scan(
        &self,
        map: &HashMap<String, Entry>,
        candidates: &[Arc<Worker>],
        key: Option<Key<'_>>,
        now: u64,
    ) -> Scan {
        let mut scan = Scan {
            best: 0,
            best_len: 0,
            lowest: 0,
            lowest_len: 0,
            from_events: vec![false; candidates.len()],
        };
        let (mut best_rank, mut lowest_rank) = ((i64::MAX, usize::MAX), (i64::MAX, usize::MAX));
        let mut keys = match key {
            Some(Key::Tokens(tokens)) => Some(PromptKeys::new(tokens)),
            _ => None,
        };
        for (i, w) in candidates.iter().enumerate() {
            let from_events = keys.as_mut().and_then(|keys| self.event_match(w, keys));
            scan.from_events[i] = from_events.is_some();
            let (tree_len, size) = match map.get(&w.base) {
                Some(entry) => {
                    entry.seen.store(now, Ordering::Relaxed);
                    let trees = lock(&entry.trees);
                    let len = match from_events {
                        Some(_) => 0,
                        None => key.map_or(0, |k| trees.match_len(k)),
                    };
                    (len, trees.size_for(key))
                }
                None => (0, 0),
            };
            let len = from_events.unwrap_or(tree_len);
            let rank = (w.load(), size);
            if i == 0 || len > scan.best_len || (len == scan.best_len && rank < best_rank) {
                (scan.best, scan.best_len, best_rank) = (i, len, rank);
            }
            if rank < lowest_rank {
                (scan.lowest, scan.lowest_len, lowest_rank) = (i, len, rank);
            }
        }
        scan
    }

    /// Records `key` under `worker`, creating its trees on first use.
    fn record(&self, role: WorkerRole, worker: &Worker, key: Key<'_>, now: u64) {
        let lock_map = &self.roles[role_index(role)];
        {
            let map = lock_map.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(entry) = map.get(&worker.base) {
                lock(&entry.trees).insert(key);
                return;
            }
        }
        let mut map = lock_map.write().unwrap_or_else(PoisonError::into_inner);
        let entry = map.entry(worker.base.clone()).or_insert_with(|| Entry {
            trees: Mutex::new(Trees {
                text: PrefixTree::new(self.max_tree_size),
                tokens: PrefixTree::new(self.max_tree_size),
            }),
            seen: AtomicU64::new(now),
        });
        entry
            .trees
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key);
    }

    /// Drops the trees of workers that have not been a candidate since `cutoff`.
    fn prune_idle(&self, cutoff: u64) {
        for role in &self.roles {
            let mut map = role.write().unwrap_or_else(PoisonError::into_inner);
            map.retain(|_, e| e.seen.load(Ordering::Relaxed) >= cutoff);
        }
    }

    fn maybe_prune(&self, now: u64) {
        let last = self.last_prune.load(Ordering::Relaxed);
        if now < last + PRUNE_CHECK_SECS {
            return;
        }
        // One request does the pass; the others go on.
        if self
            .last_prune
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.prune_idle(now.saturating_sub(IDLE_PRUNE_SECS));
        }
    }
}

/// How much of `text` its first `bytes` bytes are, in characters (a match may end inside
/// a multi-byte character; that character does not count).
fn chars_in(text: &str, bytes: usize) -> usize {
    let mut end = bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].chars().count()
}

/// Whether waiting behind the best-matching worker's extra in-flight requests would cost
/// more than computing the prefix it holds and the least-loaded worker lacks.
///
/// SGLang's gateway goes to the longest match until load differs by its absolute
/// threshold (64 requests), so a prefix every prompt shares (a system prompt) pulls all
/// traffic onto the first worker that saw it while the others idle. Here each extra
/// in-flight request can be taken to cost `queue_cost` prompts of compute
/// (`--cache-queue-cost`; on small CPU workers about 0.5, its prefill or a share of the
/// batched decode steps; on large GPU batches near 0): a worker whose lead in cached
/// tokens is smaller than that cost loses the request to the least-loaded one, which then
/// caches the shared prefix too. A long conversation history (a large lead) stays put.
/// `queue_cost` 0 (the default) keeps SGLang's behaviour.
fn queue_outweighs_cache(
    candidates: &[Arc<Worker>],
    scan: &Scan,
    prompt_len: usize,
    queue_cost: f64,
) -> bool {
    let extra = candidates[scan.best].load() - candidates[scan.lowest].load();
    let lead = scan.best_len.saturating_sub(scan.lowest_len);
    queue_cost > 0.0 && extra > 0 && extra as f64 * prompt_len as f64 * queue_cost > lead as f64
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
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
        let now = self.now();
        self.maybe_prune(now);
        let prompt = request.prompt();
        let key = prompt.as_ref().map(Key::of);
        let imbalanced = self.is_imbalanced(candidates);
        let (chosen, scan) = {
            let map = self.roles[role_index(role)]
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            // Matching is wasted work when load decides.
            let scan = self.scan(&map, candidates, key.filter(|_| !imbalanced), now);
            let chosen = if imbalanced {
                self.imbalanced.fetch_add(1, Ordering::Relaxed);
                scan.lowest
            } else if let Some(key) = key {
                let ratio = if key.len() == 0 {
                    0.0
                } else {
                    scan.best_len as f64 / key.len() as f64
                };
                let follow_match = ratio > self.cache_threshold
                    && !queue_outweighs_cache(candidates, &scan, key.len(), self.queue_cost);
                tracing::debug!(
                    %role,
                    match_ratio = ratio,
                    best = %candidates[scan.best].base,
                    best_load = candidates[scan.best].load(),
                    best_from_events = scan.from_events[scan.best],
                    lowest = %candidates[scan.lowest].base,
                    lowest_load = candidates[scan.lowest].load(),
                    follow_match,
                    "cache_aware decision"
                );
                if follow_match {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    scan.best
                } else {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    scan.lowest
                }
            } else {
                scan.lowest
            };
            (chosen, scan)
        };
        let worker = &candidates[chosen];
        let matched = if chosen == scan.best {
            scan.best_len
        } else if chosen == scan.lowest {
            scan.lowest_len
        } else {
            0
        };
        let from_events = scan.from_events[chosen];
        if let Some(key) = key.filter(|k| k.len() > 0) {
            self.record(role, worker, key, now);
            if let (Key::Tokens(tokens), Some(events)) = (key, &self.events) {
                if from_events || self.source == CacheSource::Events {
                    events.sent(worker, &mut PromptKeys::new(tokens), matched);
                }
            }
        }
        let cache = prompt.as_ref().filter(|_| !imbalanced).map(|prompt| {
            let (matched, prompt_len) = match prompt {
                RoutePrompt::Text(text) => (chars_in(text, matched), text.chars().count()),
                RoutePrompt::TokenIds(ids) => (matched, ids.len()),
            };
            CacheMatch {
                source: if from_events {
                    MatchSource::Events
                } else {
                    MatchSource::Approximate
                },
                matched,
                prompt_len,
                tokens: matches!(prompt, RoutePrompt::TokenIds(_)),
            }
        });
        Some(Choice {
            worker: worker.clone(),
            cache,
            forecast: None,
        })
    }

    fn cached_prefix(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<PrefixMatch> {
        if candidates.is_empty() {
            return None;
        }
        let prompt = request.prompt()?;
        let key = Key::of(&prompt);
        let scan = {
            let map = self.roles[role_index(role)]
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            self.scan(&map, candidates, Some(key), self.now())
        };
        if scan.best_len == 0 {
            return None;
        }
        let (matched, prompt_len) = match &prompt {
            RoutePrompt::Text(text) => (chars_in(text, scan.best_len), text.chars().count()),
            RoutePrompt::TokenIds(ids) => (scan.best_len, ids.len()),
        };
        Some(PrefixMatch {
            worker: candidates[scan.best].clone(),
            matched,
            prompt_len,
        })
    }

    fn tree_size(&self) -> usize {
        self.roles
            .iter()
            .map(|role| {
                let map = role.read().unwrap_or_else(PoisonError::into_inner);
                map.values()
                    .map(|e| lock(&e.trees).size_for(None))
                    .sum::<usize>()
            })
            .sum()
    }

    fn reads_prompt(&self) -> bool {
        true
    }

    fn stats(&self) -> PolicyStats {
        PolicyStats {
            cache_hits: self.hits.load(Ordering::Relaxed),
            cache_misses: self.misses.load(Ordering::Relaxed),
            imbalanced: self.imbalanced.load(Ordering::Relaxed),
        }
    }

    /// Only what was noted for the events' sake: the approximate tree keeps what was
    /// routed, as SGLang's does.
    fn forget_sent(&self, worker: &Worker, tokens: &[u32]) {
        if let Some(events) = &self.events {
            events.unsent(worker, &mut PromptKeys::new(tokens));
        }
    }

    fn retain_workers(&self, live: &[&str]) {
        for role in &self.roles {
            let mut map = role.write().unwrap_or_else(PoisonError::into_inner);
            map.retain(|base, _| live.contains(&base.as_str()));
        }
        if let Some(events) = &self.events {
            events.retain_workers(live);
        }
    }
}

#[cfg(test)]
#[path = "cache_aware_tests.rs"]
mod tests;
