//! How much of a prompt a worker holds by its own KV events, for the policies that route
//! on them (`precise_prefix`, `cache_aware --cache-source events|auto`).
//!
//! Events arrive once a worker has computed a prompt; until then the prompts this
//! gateway just sent a worker count as held there too (for `PENDING_FOR`), or every
//! request of a new shared prefix that arrives at once would find it nowhere and spread,
//! each worker computing it again. A prompt sent to a worker that must compute new
//! blocks for it makes its stream owe events (see `--kv-events-stale-secs`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fleet::kv_events::{BlockIndex, BlockKey, KvEventsHub, PromptKeys, WorkerEvents};
use crate::fleet::registry::Worker;

/// How long a prompt sent to a worker counts as cached there before its events say so.
const PENDING_FOR: Duration = Duration::from_secs(10);
/// Blocks remembered as pending per worker.
pub(crate) const PENDING_BLOCKS: usize = 65_536;
/// The block size pending prompts are cut into before a worker's events have said its
/// own (vLLM's and pdserve's default).
const PROVISIONAL_BLOCK_SIZE: usize = 16;

/// What a worker holds of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Tokens from the prompt's start, in whole blocks: what its events say, continued
    /// by what this gateway just sent it.
    pub tokens: usize,
    /// Whether the worker has a trusted event index (it publishes, and is not stale).
    pub indexed: bool,
}

/// Blocks of prompts recently sent to each worker (by base URL; foldhash, as every
/// routing decision looks up every candidate).
type Pending = HashMap<String, SentBlocks, foldhash::fast::FixedState>;

/// Blocks of prompts recently sent to one worker, with when; sends leave after
/// `PENDING_FOR`, and past `PENDING_BLOCKS` the oldest leave first. A plain map and a
/// queue rather than an LRU cache: a new prompt of 8k tokens puts 512 blocks on every
/// routing decision.
#[derive(Debug, Default)]
struct SentBlocks {
    at: HashMap<BlockKey, Instant, foldhash::fast::FixedState>,
    order: VecDeque<(BlockKey, Instant)>,
}

impl SentBlocks {
    fn get(&self, key: &BlockKey) -> Option<&Instant> {
        self.at.get(key)
    }

    fn put(&mut self, key: BlockKey, now: Instant) {
        self.at.insert(key, now);
        self.order.push_back((key, now));
        // Sends older than `PENDING_FOR` count for nothing: they leave too, so a large
        // fleet holds only the last seconds' sends, not `PENDING_BLOCKS` per worker.
        while let Some(&(old, when)) = self.order.front() {
            if self.order.len() <= PENDING_BLOCKS && now.duration_since(when) < PENDING_FOR {
                break;
            }
            self.order.pop_front();
            // A block sent again since is queued again: this entry no longer owns it.
            if self.at.get(&old) == Some(&when) {
                self.at.remove(&old);
            }
        }
    }
}

/// Blocks of `keys`, from the first, that were sent within `PENDING_FOR` and that the
/// worker's `index` has not removed since (it cached them, then evicted them: they are
/// gone, however recently sent). Keys chain over their prefix, so a sent block past the
/// ones the index holds continues that same prefix.
fn sent_prefix(
    blocks: &SentBlocks,
    keys: &[BlockKey],
    index: Option<&BlockIndex>,
    now: Instant,
) -> usize {
    keys.iter()
        .take_while(|key| {
            blocks.get(key).is_some_and(|at| {
                now.duration_since(*at) < PENDING_FOR
                    && !index.is_some_and(|i| i.removed_since(key, *at))
            })
        })
        .count()
}

/// The workers' event indexes, plus the prompts recently sent to each.
#[derive(Debug)]
pub struct EventMatcher {
    hub: Arc<KvEventsHub>,
    /// Blocks of prompts recently sent to each worker, with when.
    pending: Mutex<Pending>,
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

    /// What `worker` holds of the prompt `keys` are of.
    pub fn held(&self, worker: &Worker, keys: &mut PromptKeys<'_>) -> Held {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        self.held_with(&pending, worker, keys, Instant::now())
    }

    /// What each of `candidates` holds of the prompt `keys` are of, in their order: one
    /// lock of what was sent and one clock read for the whole fleet.
    pub fn held_by_each(&self, candidates: &[Arc<Worker>], keys: &mut PromptKeys<'_>) -> Vec<Held> {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        candidates
            .iter()
            .map(|w| self.held_with(&pending, w, keys, now))
            .collect()
    }

    fn held_with(
        &self,
        pending: &Pending,
        worker: &Worker,
        keys: &mut PromptKeys<'_>,
        now: Instant,
    ) -> Held {
        let events = self.hub.worker(&worker.base);
        let index = events.as_deref().map(WorkerEvents::lock);
        let events_block_size = index.as_ref().and_then(|i| i.block_size());
        let block_size = events_block_size.map_or(PROVISIONAL_BLOCK_SIZE, |b| b as usize);
        let keys = keys.get(block_size);
        let indexed = events.as_ref().is_some_and(|e| !e.is_stale());
        let cached = match index.as_deref() {
            Some(index) if indexed && events_block_size.is_some() => index.cached_prefix(keys),
            _ => 0,
        };
        // What the index holds, continued by what was sent since: the blocks the worker
        // is computing now, or computed and has not reported yet.
        let sent = pending.get(&worker.base).map_or(0, |blocks| {
            sent_prefix(blocks, &keys[cached..], index.as_deref(), now)
        });
        Held {
            tokens: (cached + sent) * block_size,
            indexed,
        }
    }

    /// Remembers that the prompt `keys` are of went to `worker`, which held `held` of
    /// its tokens: when it must compute a new block, its stream owes the events.
    pub fn sent(&self, worker: &Worker, keys: &mut PromptKeys<'_>, held: usize) {
        let block_size = self.block_size(&worker.base);
        if keys.tokens().len().saturating_sub(held) >= block_size {
            if let Some(events) = self.hub.worker(&worker.base) {
                events.expect_events();
            }
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let blocks = pending.entry(worker.base.clone()).or_default();
        let now = Instant::now();
        // The blocks it held are not sent work: the index has them, or they are here
        // from an earlier send.
        for key in keys.get(block_size).iter().skip(held / block_size) {
            blocks.put(*key, now);
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
    fn sent_blocks_keep_the_newest_sends_and_a_block_sent_again() {
        let mut sent = SentBlocks::default();
        let t0 = Instant::now();
        for i in 0..PENDING_BLOCKS as u64 {
            sent.put(BlockKey(i), t0);
        }
        let t1 = t0 + Duration::from_millis(1);
        // Sent again: its first send leaves the queue without taking it along.
        sent.put(BlockKey(0), t1);
        sent.put(BlockKey(PENDING_BLOCKS as u64), t1);
        assert_eq!(sent.get(&BlockKey(0)), Some(&t1));
        assert_eq!(sent.get(&BlockKey(1)), None, "the oldest send left");
        assert!(sent.get(&BlockKey(2)).is_some());
        assert_eq!(sent.at.len(), PENDING_BLOCKS);
        assert_eq!(sent.order.len(), PENDING_BLOCKS);
        // Once they count for nothing, old sends leave with the next one.
        sent.put(BlockKey(u64::MAX), t1 + PENDING_FOR);
        assert_eq!(sent.get(&BlockKey(2)), None);
        assert_eq!(sent.get(&BlockKey(0)), None);
        assert_eq!((sent.at.len(), sent.order.len()), (1, 1));
    }

    #[test]
    fn a_sent_prompt_counts_as_held_until_the_workers_events_remove_it() {
        let metrics = Arc::new(KvEventMetrics::register(&mut Registry::default()));
        let hub = Arc::new(KvEventsHub::new(KvEventsConfig::default(), metrics));
        let matcher = EventMatcher::new(hub.clone());
        let worker = &workers(WorkerRole::Decode, &[1])[0];
        let events = hub.collected(&worker.base).unwrap();
        let prompt: Vec<u32> = (0..40).collect();
        let held = || matcher.held(worker, &mut PromptKeys::new(&prompt)).tokens;
        // An unrelated block says the worker's block size.
        events.lock().apply(&stored(&[99], None, &[7; 16])).unwrap();
        matcher.sent(worker, &mut PromptKeys::new(&prompt), 0);
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
        matcher.sent(worker, &mut PromptKeys::new(&prompt), 16);
        assert_eq!(held(), 32);
        // A clear takes everything sent before it.
        events
            .lock()
            .apply(&KvCacheEvent::AllBlocksCleared)
            .unwrap();
        assert_eq!(held(), 0);
    }
}
