//! How much of a prompt a worker holds by its own KV events, for the policies that route
//! on them (`precise_prefix`, `cache_aware --cache-source events|auto`).
//!
//! Events arrive once a worker has computed a prompt; until then the prompts this
//! gateway just sent a worker count as held there too (for `PENDING_FOR`), or every
//! request of a new shared prefix that arrives at once would find it nowhere and spread,
//! each worker computing it again. A prompt sent to a worker that must compute new
//! blocks for it makes its stream owe events (see `--kv-events-stale-secs`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use smallvec::SmallVec;

use super::sent_blocks::{Recipient, SentBlocks};
use crate::fleet::kv_events::first_blocks::IndexId;
use crate::fleet::kv_events::{BlockKey, FirstBlocks, KvEventsHub, PromptKeys, WorkerEvents};
use crate::fleet::registry::Worker;

/// The block size pending prompts are cut into before a worker's events have said its
/// own (vLLM's and pdserve's default).
const PROVISIONAL_BLOCK_SIZE: usize = 16;

/// A worker's block size as its events say, else the provisional one.
fn block_size_of(events: Option<&WorkerEvents>) -> usize {
    events
        .and_then(WorkerEvents::block_size)
        .map_or(PROVISIONAL_BLOCK_SIZE, |b| b as usize)
}

/// What a worker holds of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Tokens from the prompt's start, in whole blocks: what its events say, continued
    /// by what this gateway just sent it.
    pub tokens: usize,
    /// Whether the worker has a trusted event index (it publishes, and is not stale).
    pub indexed: bool,
}

/// One candidate after its own index was read.
struct Indexed<'e> {
    events: Option<&'e WorkerEvents>,
    block_size: usize,
    /// Blocks its index holds.
    cached: usize,
    indexed: bool,
}

/// Who holds a prompt's first block: only their indexes can hold any of it. Read from
/// the fleet's map once per block size (in practice one per decision).
struct FirstHolders<'m> {
    map: &'m FirstBlocks,
    by_size: Vec<(usize, SmallVec<[IndexId; 4]>)>,
}

impl FirstHolders<'_> {
    /// Whether index `id` holds `first`, the prompt's first block at `block_size`.
    fn include(&mut self, block_size: usize, first: &BlockKey, id: IndexId) -> bool {
        let at = match self.by_size.iter().position(|(s, _)| *s == block_size) {
            Some(at) => at,
            None => {
                self.by_size.push((block_size, self.map.holders(first)));
                self.by_size.len() - 1
            }
        };
        self.by_size[at].1.binary_search(&id).is_ok()
    }
}

/// The workers' event indexes, plus the prompts recently sent to each.
#[derive(Debug)]
pub struct EventMatcher {
    hub: Arc<KvEventsHub>,
    /// Blocks of prompts recently sent, fleet-wide.
    sent: Mutex<SentBlocks>,
}

impl EventMatcher {
    /// Matches against `hub`'s indexes.
    pub fn new(hub: Arc<KvEventsHub>) -> Self {
        Self {
            hub,
            sent: Mutex::default(),
        }
    }

    /// What `worker` holds of the prompt `keys` are of.
    pub fn held(&self, worker: &Worker, keys: &mut PromptKeys<'_>) -> Held {
        self.held_of(&[worker], keys)[0]
    }

    /// What each of `candidates` holds of the prompt `keys` are of, in their order: each
    /// candidate's index is read once, then the prompt's blocks are looked up once among
    /// what was sent, with one clock read for the whole fleet.
    pub fn held_by_each(&self, candidates: &[Arc<Worker>], keys: &mut PromptKeys<'_>) -> Vec<Held> {
        let candidates: Vec<&Worker> = candidates.iter().map(|w| &**w).collect();
        self.held_of(&candidates, keys)
    }

    fn held_of(&self, candidates: &[&Worker], keys: &mut PromptKeys<'_>) -> Vec<Held> {
        // Each pass over the candidates is a loop of its own whose loads do not depend on
        // one another (the ids, then the hub's table, then each index's atomics), so the
        // processor overlaps a pass's memory misses instead of waiting out one chain of
        // them per candidate.
        let ids: Vec<u64> = candidates.iter().map(|w| w.id()).collect();
        self.hub
            .with_ids(&ids, |events| self.held_with(candidates, events, keys))
    }

    fn held_with(
        &self,
        candidates: &[&Worker],
        events: &[Option<&WorkerEvents>],
        keys: &mut PromptKeys<'_>,
    ) -> Vec<Held> {
        let mut first_holders = FirstHolders {
            map: self.hub.first_blocks(),
            by_size: Vec::new(),
        };
        // Only the indexes that hold the prompt's first block are locked: the others are
        // read by their atomics, so one candidate's cache misses need not wait for the
        // last one's lock.
        let said: Vec<(Option<u32>, bool)> = events
            .iter()
            .map(|e| {
                (
                    e.and_then(WorkerEvents::block_size),
                    e.is_some_and(|e| !e.is_stale()),
                )
            })
            .collect();
        let read: Vec<Indexed> = events
            .iter()
            .zip(said)
            .map(|(&events, (events_block_size, indexed))| {
                let block_size = events_block_size.map_or(PROVISIONAL_BLOCK_SIZE, |b| b as usize);
                let cached = match events {
                    Some(events) if indexed && events_block_size.is_some() => {
                        let keys = keys.get(block_size);
                        let holds_first = match (events.first_block_id(), keys.first()) {
                            (Some(id), Some(first)) => first_holders.include(block_size, first, id),
                            // An index outside a hub (tests) is probed.
                            (None, _) => true,
                            (_, None) => false,
                        };
                        let index = holds_first.then(|| events.lock());
                        // The size is read again under the lock: an index rebuilt for
                        // another size since holds nothing of these keys.
                        match index {
                            Some(index) if index.block_size() == events_block_size => {
                                index.cached_prefix(keys)
                            }
                            _ => 0,
                        }
                    }
                    _ => 0,
                };
                Indexed {
                    events,
                    block_size,
                    cached,
                    indexed,
                }
            })
            .collect();
        for r in &read {
            keys.get(r.block_size);
        }
        let sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // One prompt per block size among the candidates (in practice one).
        let mut prompts: Vec<(usize, _)> = Vec::new();
        candidates
            .iter()
            .zip(&read)
            .map(|(worker, r)| {
                let at = match prompts.iter().position(|(size, _)| *size == r.block_size) {
                    Some(at) => at,
                    None => {
                        let prompt_keys = keys.computed(r.block_size).unwrap_or_default();
                        prompts.push((r.block_size, sent.prompt(prompt_keys)));
                        prompts.len() - 1
                    }
                };
                // What the index holds, continued by what was sent since: the blocks the
                // worker is computing now, or computed and has not reported yet.
                let more = prompts[at].1.prefix(
                    Recipient::worker(worker),
                    r.cached,
                    || r.events.map(WorkerEvents::lock),
                    now,
                );
                Held {
                    tokens: (r.cached + more) * r.block_size,
                    indexed: r.indexed,
                }
            })
            .collect()
    }

    /// Remembers that the prompt `keys` are of went to `worker`, which held `held` of
    /// its tokens: when it must compute a new block, its stream owes the events.
    pub fn sent(&self, worker: &Worker, keys: &mut PromptKeys<'_>, held: usize) {
        // By the worker's id: no URL hashed, no reference count touched.
        let new_tokens = keys.tokens().len().saturating_sub(held);
        let block_size = self.hub.with_id(worker.id(), |events| {
            let block_size = block_size_of(events);
            if let Some(events) = events.filter(|_| new_tokens >= block_size) {
                events.expect_events();
            }
            block_size
        });
        let keys = keys.get(block_size);
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        // The blocks it held are not sent work: the index has them, or they are here
        // from an earlier send.
        sent.record(
            Recipient::worker(worker),
            keys,
            held / block_size,
            Instant::now(),
        );
    }

    /// Forgets that the prompt `keys` are of went to `worker`: it refused the request or
    /// never got it, so it computes none of it and no events will say otherwise.
    pub fn unsent(&self, worker: &Worker, keys: &mut PromptKeys<'_>) {
        let block_size = self.hub.with_id(worker.id(), block_size_of);
        let keys = keys.get(block_size);
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        sent.forget(Recipient::worker(worker), keys);
    }

    /// Drops what was sent to workers whose base URL is not in `live`.
    pub fn retain_workers(&self, live: &[&str]) {
        let live: Vec<Recipient> = live.iter().map(|base| Recipient::of(base)).collect();
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        sent.retain(|r| live.contains(&r));
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

    #[test]
    fn a_prompt_the_worker_refused_is_not_held_there() {
        let metrics = Arc::new(KvEventMetrics::register(&mut Registry::default()));
        let hub = Arc::new(KvEventsHub::new(KvEventsConfig::default(), metrics));
        let matcher = EventMatcher::new(hub.clone());
        let pool = workers(WorkerRole::Decode, &[1, 2]);
        let prompt: Vec<u32> = (0..2000).collect();
        for worker in &pool {
            let events = hub.collected(&worker.base).unwrap();
            events.lock().apply(&stored(&[99], None, &[7; 16])).unwrap();
        }
        let held = |w: usize| matcher.held(&pool[w], &mut PromptKeys::new(&prompt)).tokens;
        matcher.sent(&pool[0], &mut PromptKeys::new(&prompt), 0);
        matcher.sent(&pool[1], &mut PromptKeys::new(&prompt), 0);
        assert_eq!((held(0), held(1)), (2000, 2000));
        // The first answered 404 (say, another model's name): it computed nothing.
        matcher.unsent(&pool[0], &mut PromptKeys::new(&prompt));
        assert_eq!((held(0), held(1)), (0, 2000));
    }
}
