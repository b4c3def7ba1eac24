//! How much of a prompt a worker holds by its own KV events, for the policies that route
//! on them (`precise_prefix`, `cache_aware --cache-source events|auto`).
//!
//! Events arrive once a worker has computed a prompt; until then the prompts this
//! gateway just sent a worker count as held there too (for `PENDING_FOR`), or every
//! request of a new shared prefix that arrives at once would find it nowhere and spread,
//! each worker computing it again. A prompt sent to a worker that must compute new
//! blocks for it makes its stream owe events (see `--kv-events-stale-secs`).

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::fleet::kv_events::{prompt_keys, BlockKey, KvEventsHub, WorkerEvents};
use crate::fleet::registry::Worker;

/// How long a prompt sent to a worker counts as cached there before its events say so.
const PENDING_FOR: Duration = Duration::from_secs(10);
/// Blocks remembered as pending per worker.
const PENDING_BLOCKS: usize = 65_536;
/// The block size pending prompts are cut into before a worker's events have said its
/// own (vLLM's and pdserve's default).
const PROVISIONAL_BLOCK_SIZE: usize = 16;

/// What a worker holds of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Tokens from the prompt's start, in whole blocks: what its events say, or what
    /// this gateway just sent it, whichever is more.
    pub tokens: usize,
    /// Whether the worker has a trusted event index (it publishes, and is not stale).
    pub indexed: bool,
}

/// The workers' event indexes, plus the prompts recently sent to each.
#[derive(Debug)]
pub struct EventMatcher {
    hub: Arc<KvEventsHub>,
    /// Blocks of prompts recently sent to each worker, with when.
    pending: Mutex<HashMap<String, LruCache<BlockKey, Instant>>>,
}

impl EventMatcher {
    /// Matches against `hub`'s indexes.
    pub fn new(hub: Arc<KvEventsHub>) -> Self {
        Self {
            hub,
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

    /// What `worker` holds of `tokens`.
    pub fn held(&self, worker: &Worker, tokens: &[u32]) -> Held {
        let events = self.hub.worker(&worker.base);
        let trusted = events.as_ref().filter(|e| !e.is_stale());
        let indexed = trusted.is_some();
        let cached = trusted.and_then(|e| e.cached_tokens(tokens)).unwrap_or(0);
        let pending = self.pending_tokens(&worker.base, events.as_deref(), tokens);
        Held {
            tokens: cached.max(pending),
            indexed,
        }
    }

    /// Tokens of `tokens` from the start that this gateway sent `worker` within
    /// `PENDING_FOR`, in whole blocks of its block size, less what its `events` removed
    /// after it was sent (the worker cached it, then evicted it: it is gone, however
    /// recently sent).
    fn pending_tokens(&self, worker: &str, events: Option<&WorkerEvents>, tokens: &[u32]) -> usize {
        let block_size = self.block_size(worker);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(blocks) = pending.get_mut(worker) else {
            return 0;
        };
        let index = events.map(WorkerEvents::lock);
        // One clock read for the whole prompt, not one per block.
        let now = Instant::now();
        let held = |key: &BlockKey, at: &Instant| {
            now.duration_since(*at) < PENDING_FOR
                && !index.as_ref().is_some_and(|i| i.removed_since(key, *at))
        };
        prompt_keys(tokens, block_size)
            .iter()
            .take_while(|key| blocks.get(*key).is_some_and(|at| held(key, at)))
            .count()
            * block_size
    }

    /// Remembers that `tokens` went to `worker`, which held `held` of them: when it must
    /// compute a new block, its stream owes the events.
    pub fn sent(&self, worker: &Worker, tokens: &[u32], held: usize) {
        let block_size = self.block_size(&worker.base);
        if tokens.len().saturating_sub(held) >= block_size {
            if let Some(events) = self.hub.worker(&worker.base) {
                events.expect_events();
            }
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let blocks = pending
            .entry(worker.base.clone())
            .or_insert_with(|| LruCache::new(NonZeroUsize::new(PENDING_BLOCKS).expect("non-zero")));
        let now = Instant::now();
        for key in prompt_keys(tokens, block_size) {
            blocks.put(key, now);
        }
    }

    /// Drops what was sent to workers whose base URL is not in `live`.
    pub fn retain_workers(&self, live: &[&str]) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|base, _| live.contains(&base.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use pdserve_protocol::kv_events::{EngineBlockHash, KvCacheEvent};
    use pdserve_protocol::WorkerRole;
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::fleet::kv_events::{KvEventMetrics, KvEventsConfig};
    use crate::policy::testing::workers;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvCacheEvent {
        KvCacheEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| EngineBlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(EngineBlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 16,
            lora_id: None,
            medium: None,
            lora_name: None,
        }
    }

    #[test]
    fn a_sent_prompt_counts_as_held_until_the_workers_events_remove_it() {
        let metrics = Arc::new(KvEventMetrics::register(&mut Registry::default()));
        let hub = Arc::new(KvEventsHub::new(KvEventsConfig::default(), metrics));
        let matcher = EventMatcher::new(hub.clone());
        let worker = &workers(WorkerRole::Decode, &[1])[0];
        let events = hub.collected(&worker.base).unwrap();
        let prompt: Vec<u32> = (0..40).collect();
        let held = || matcher.held(worker, &prompt).tokens;
        // An unrelated block says the worker's block size.
        events.lock().apply(&stored(&[99], None, &[7; 16])).unwrap();
        matcher.sent(worker, &prompt, 0);
        assert_eq!(held(), 32, "sent, not yet in its events");
        // The worker computes both blocks, then evicts the second: sent or not, only
        // the first is there.
        events
            .lock()
            .apply(&stored(&[1, 2], None, &prompt[..32]))
            .unwrap();
        events
            .lock()
            .apply(&KvCacheEvent::BlockRemoved {
                block_hashes: vec![EngineBlockHash::Int(2)],
                medium: None,
            })
            .unwrap();
        assert_eq!(held(), 16);
        // Sent again after the eviction: on its way back.
        matcher.sent(worker, &prompt, 16);
        assert_eq!(held(), 32);
        // A clear takes everything sent before it.
        events
            .lock()
            .apply(&KvCacheEvent::AllBlocksCleared)
            .unwrap();
        assert_eq!(held(), 0);
    }
}
