//! One worker's prefix-cache contents as its KV events describe them, keyed by the
//! gateway's own hash of each block's tokens chained over its parent's key. The engine's
//! hashes (seeded per process in vLLM unless PYTHONHASHSEED is set, sha256 or integers)
//! are kept only to resolve removals and parents, so a match never depends on how an
//! engine hashes.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::time::Instant;

use lru::LruCache;
use pdserve_protocol::kv_events::{EngineBlockHash, KvCacheEvent};

use super::first_blocks::{FirstBlockSink, IndexId};
use super::keys::BlockKey;

/// Why an index no longer describes its worker and must start over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexFault {
    /// The worker's blocks grew (another engine behind the URL, a restart with other
    /// settings): keys computed with the old size mean nothing. Smaller blocks are a
    /// partial last page and are only skipped.
    #[error("the block size changed from {before} to {now}")]
    BlockSizeChanged {
        /// The size the index was built with.
        before: u32,
        /// The size the event has.
        now: u32,
    },
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks added.
    pub stored: usize,
    /// Blocks removed.
    pub removed: usize,
    /// Blocks left out: their parent is not in the index (evicted here, or stored before
    /// this gateway listened), so no prompt walk from the start could reach them.
    pub orphaned: usize,
    /// Blocks left out because the event was malformed (token count not a multiple).
    pub malformed: usize,
    /// Blocks left out because they are shorter than the worker's blocks (a partial
    /// last page).
    pub partial: usize,
}

/// An indexed block: the engine's hash for it, the key of the block before it, and how
/// many indexed blocks follow it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Indexed {
    engine: EngineBlockHash,
    parent: Option<BlockKey>,
    /// Kept here rather than in a map of its own: a block's parent was nearly always
    /// stored just before it, so counting it there touches memory already in cache.
    children: u32,
}

/// A bounded index of one worker's cached blocks, least recently stored evicted first.
#[derive(Debug)]
pub struct BlockIndex {
    block_size: Option<u32>,
    blocks: LruCache<BlockKey, Indexed>,
    /// foldhash (seeded per process), not SipHash: every stored block is looked up here
    /// once or twice.
    by_engine: HashMap<EngineBlockHash, BlockKey, foldhash::fast::RandomState>,
    /// When blocks not stored again since were removed: a prompt the gateway sent the
    /// worker before that no longer counts as held there (see [`Self::removed_since`]).
    /// Grows as removals come (at most `capacity`), not allocated up front.
    removed_at: LruCache<BlockKey, Instant>,
    capacity: NonZeroUsize,
    /// When the worker last said it cleared everything.
    cleared_at: Option<Instant>,
    /// A block left while blocks stored after it stayed (or one was stored after a block
    /// not held), so a prompt's held blocks may have gaps and [`Self::cached_prefix`]
    /// must look at each one. Engines evict a
    /// sequence's last blocks first (vLLM frees them in reverse order, SGLang evicts
    /// radix leaves), and a block is indexed only under a held parent, so this stays
    /// false in practice until the index is cleared.
    gaps: bool,
    /// Where the fleet learns which first blocks this index holds, for an index in a hub.
    first_blocks: Option<FirstBlockSink>,
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        self.drop_first_blocks();
    }
}

impl BlockIndex {
    /// An empty index holding at most `capacity` blocks.
    pub fn new(capacity: NonZeroUsize) -> Self {
        Self {
            block_size: None,
            blocks: LruCache::new(capacity),
            by_engine: HashMap::default(),
            removed_at: LruCache::unbounded(),
            capacity,
            cleared_at: None,
            gaps: false,
            first_blocks: None,
        }
    }

    /// An empty index of at most `capacity` blocks that tells `first_blocks` which
    /// prompts' first blocks it holds.
    pub fn reporting(capacity: NonZeroUsize, first_blocks: FirstBlockSink) -> Self {
        let mut index = Self::new(capacity);
        index.first_blocks = Some(first_blocks);
        index
    }

    /// The index's number in the fleet's first-block map, when it reports there.
    pub fn first_block_id(&self) -> Option<IndexId> {
        self.first_blocks.as_ref().map(FirstBlockSink::id)
    }

    /// Takes every first block this index holds out of the fleet's map.
    fn drop_first_blocks(&mut self) {
        if let Some(sink) = &self.first_blocks {
            let firsts = self.blocks.iter().filter(|(_, b)| b.parent.is_none());
            sink.remove(firsts.map(|(key, _)| *key));
        }
    }

    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The worker's tokens per block, once an event has said.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Forgets everything (the block size too).
    pub fn clear(&mut self) {
        self.drop_first_blocks();
        self.blocks.clear();
        self.by_engine.clear();
        self.removed_at.clear();
        self.cleared_at = None;
        self.block_size = None;
        self.gaps = false;
    }

    /// Counts block `key`, stored after `parent`.
    fn added(&mut self, key: BlockKey, parent: Option<BlockKey>) {
        match parent {
            Some(parent) => match self.blocks.peek_mut(&parent) {
                Some(held) => held.children += 1,
                // Its parent left while it was stored (an engine that reused its
                // parent's hash for it): a gap from the start.
                None => self.gaps = true,
            },
            None => {
                if let Some(sink) = &self.first_blocks {
                    sink.add(key);
                }
            }
        }
    }

    /// Accounts for block `key` leaving the index.
    fn left(&mut self, key: BlockKey, block: &Indexed) {
        if block.children > 0 {
            self.gaps = true;
        }
        match block.parent {
            Some(parent) => {
                // A parent that left first already set `gaps`, which only a clear
                // resets: its count no longer matters.
                if let Some(held) = self.blocks.peek_mut(&parent) {
                    held.children = held.children.saturating_sub(1);
                }
            }
            None => {
                if let Some(sink) = &self.first_blocks {
                    sink.remove([key]);
                }
            }
        }
    }

    /// Records that the worker removed block `key` at `now`.
    fn note_removed(&mut self, key: BlockKey, now: Instant) {
        self.removed_at.put(key, now);
        if self.removed_at.len() > self.capacity.get() {
            self.removed_at.pop_lru();
        }
    }

    /// Whether the worker's events removed block `key` (or cleared everything) after
    /// `at` and have not stored it again: a prompt sent the worker at `at` may have been
    /// cached there since, but is gone now.
    pub fn removed_since(&self, key: &BlockKey, at: Instant) -> bool {
        self.cleared_at.is_some_and(|cleared| cleared > at)
            || self
                .removed_at
                .peek(key)
                .is_some_and(|removed| *removed > at)
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &KvCacheEvent) -> Result<Applied, IndexFault> {
        let mut applied = Applied::default();
        match event {
            KvCacheEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                match self.block_size {
                    // SGLang sends a node's last, partial page with its own length:
                    // no full-block prompt key can match it.
                    Some(before) if *block_size < before => {
                        applied.partial = block_hashes.len();
                        return Ok(applied);
                    }
                    Some(before) if *block_size > before => {
                        return Err(IndexFault::BlockSizeChanged {
                            before,
                            now: *block_size,
                        });
                    }
                    _ => {}
                }
                self.block_size = Some(*block_size);
                let size = *block_size as usize;
                if token_ids.len() != block_hashes.len() * size {
                    applied.malformed = block_hashes.len();
                    return Ok(applied);
                }
                let mut parent = match parent_block_hash {
                    None => None,
                    Some(engine) => match self.by_engine.get(engine) {
                        Some(key) => Some(*key),
                        None => {
                            applied.orphaned = block_hashes.len();
                            return Ok(applied);
                        }
                    },
                };
                for (engine, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(size)) {
                    let key = BlockKey::chain(parent, tokens);
                    // An engine hash stored again (re-computed after eviction) moves.
                    if let Some(old) = self.by_engine.insert(engine.clone(), key) {
                        if old != key {
                            if let Some(block) = self.blocks.pop(&old) {
                                self.left(old, &block);
                            }
                            self.note_removed(old, Instant::now());
                        }
                    }
                    // The same block again (keys chain over their parent, so the parent
                    // is the same): now the most recently stored, perhaps under another
                    // engine hash, which no longer resolves.
                    if let Some(held) = self.blocks.get_mut(&key) {
                        if held.engine != *engine {
                            let before = std::mem::replace(&mut held.engine, engine.clone());
                            if self.by_engine.get(&before) == Some(&key) {
                                self.by_engine.remove(&before);
                            }
                        }
                    } else {
                        let block = Indexed {
                            engine: engine.clone(),
                            parent,
                            children: 0,
                        };
                        let evicted = self.blocks.push(key, block);
                        self.added(key, parent);
                        // Past the cap: the least recently stored block was pushed out.
                        if let Some((evicted_key, evicted)) = evicted {
                            self.left(evicted_key, &evicted);
                            if self.by_engine.get(&evicted.engine) == Some(&evicted_key) {
                                self.by_engine.remove(&evicted.engine);
                            }
                        }
                    }
                    // Most indexes have seen no removal: no lookup for them.
                    if !self.removed_at.is_empty() {
                        self.removed_at.pop(&key);
                    }
                    applied.stored += 1;
                    parent = Some(key);
                }
            }
            KvCacheEvent::BlockRemoved { block_hashes, .. } => {
                // One clock read for the event, not one per block it removes.
                let now = Instant::now();
                for engine in block_hashes {
                    if let Some(key) = self.by_engine.remove(engine) {
                        if let Some(block) = self.blocks.pop(&key) {
                            applied.removed += 1;
                            self.left(key, &block);
                        }
                        self.note_removed(key, now);
                    }
                }
            }
            KvCacheEvent::AllBlocksCleared => {
                applied.removed = self.blocks.len();
                let block_size = self.block_size;
                self.clear();
                // A clear empties the cache; it does not change the engine.
                self.block_size = block_size;
                self.cleared_at = Some(Instant::now());
            }
        }
        Ok(applied)
    }

    /// How many of `keys`, from the first, the worker holds (its cached prefix in
    /// blocks). Without gaps (see `gaps`), held blocks of one prompt are its first ones,
    /// so a binary search finds where they end: a miss costs one look-up and a whole
    /// prompt held two, where a walk over an 8k-token prompt took 512.
    pub fn cached_prefix(&self, keys: &[BlockKey]) -> usize {
        let held = |key: &BlockKey| self.blocks.contains(key);
        if self.gaps {
            return keys.iter().take_while(|key| held(key)).count();
        }
        held_prefix(keys, held)
    }
}

/// How many of `keys`, from the first, `held` says are held, for holdings that are a
/// prefix (if a key is held, so is every key before it): the first and the last are
/// looked up, then a binary search between them.
fn held_prefix(keys: &[BlockKey], held: impl Fn(&BlockKey) -> bool) -> usize {
    let Some((first, last)) = keys.first().zip(keys.last()) else {
        return 0;
    };
    if !held(first) {
        return 0;
    }
    if held(last) {
        return keys.len();
    }
    // keys[lo] is held, keys[hi] is not.
    let (mut lo, mut hi) = (0, keys.len() - 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if held(&keys[mid]) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::kv_events::keys::prompt_keys;

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        block_size: u32,
    ) -> KvCacheEvent {
        KvCacheEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| EngineBlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(EngineBlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
        }
    }

    fn removed(hashes: &[u64]) -> KvCacheEvent {
        KvCacheEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|h| EngineBlockHash::Int(*h)).collect(),
            medium: None,
        }
    }

    fn index(cap: usize) -> BlockIndex {
        BlockIndex::new(NonZeroUsize::new(cap).unwrap())
    }

    #[test]
    fn prompts_match_what_the_events_stored_whatever_the_engine_hashes() {
        let mut idx = index(100);
        let prompt: Vec<u32> = (0..10).collect();
        // Two events of one chain, hashed by the engine in its own way.
        idx.apply(&stored(&[900, 901], None, &prompt[..4], 2))
            .unwrap();
        idx.apply(&stored(&[77], Some(901), &prompt[4..6], 2))
            .unwrap();
        assert_eq!(idx.len(), 3);
        let keys = prompt_keys(&prompt, 2);
        assert_eq!(keys.len(), 5);
        assert_eq!(idx.cached_prefix(&keys), 3);
        // Another prompt sharing the first block only.
        let other = [0u32, 1, 9, 9, 4, 5];
        assert_eq!(idx.cached_prefix(&prompt_keys(&other, 2)), 1);
        // A removal in the middle cuts the prefix there.
        idx.apply(&removed(&[901])).unwrap();
        assert_eq!(idx.cached_prefix(&keys), 1);
        // An unknown parent: nothing reachable is added.
        let applied = idx.apply(&stored(&[5], Some(12345), &[1, 2], 2)).unwrap();
        assert_eq!((applied.stored, applied.orphaned), (0, 1));
        // Malformed: tokens do not fill the blocks.
        assert_eq!(
            idx.apply(&stored(&[6], None, &[1], 2)).unwrap().malformed,
            1
        );
        // The removal is remembered against what was sent before it, not after.
        let key = keys[1];
        let before = Instant::now();
        idx.apply(&removed(&[900])).unwrap();
        assert!(idx.removed_since(&keys[0], before));
        assert!(!idx.removed_since(&keys[0], Instant::now()));
        assert!(!idx.removed_since(&key, Instant::now()));
        // Stored again: no longer removed.
        idx.apply(&stored(&[900], None, &prompt[..2], 2)).unwrap();
        assert!(!idx.removed_since(&keys[0], before));
        let before = Instant::now();
        idx.apply(&KvCacheEvent::AllBlocksCleared).unwrap();
        assert!(idx.removed_since(&keys[4], before));
        assert!(idx.is_empty());
        assert_eq!(idx.block_size(), Some(2), "a clear keeps the block size");
    }

    #[test]
    fn the_binary_search_finds_where_a_held_prefix_ends() {
        let keys: Vec<BlockKey> = (0..37).map(BlockKey).collect();
        for held in 0..=keys.len() {
            let found = held_prefix(&keys, |k| (k.0 as usize) < held);
            assert_eq!(found, held);
        }
        assert_eq!(held_prefix(&[], |_| true), 0);
    }

    #[test]
    fn blocks_evicted_from_the_end_keep_the_fast_path_and_a_gap_falls_back_to_the_walk() {
        let mut idx = index(100);
        let prompt: Vec<u32> = (0..12).collect();
        let keys = prompt_keys(&prompt, 2);
        idx.apply(&stored(&[1, 2, 3, 4, 5, 6], None, &prompt, 2))
            .unwrap();
        assert_eq!(idx.cached_prefix(&keys), 6);
        // The engine evicts from the end, as vLLM and SGLang do.
        idx.apply(&removed(&[6, 5])).unwrap();
        assert!(!idx.gaps);
        assert_eq!(idx.cached_prefix(&keys), 4);
        for held in 0..4 {
            assert_eq!(idx.cached_prefix(&keys[..held]), held);
        }
        // A block leaves from the middle: the blocks after it stay indexed, and the
        // walk stops at the gap.
        idx.apply(&removed(&[2])).unwrap();
        assert!(idx.gaps);
        assert_eq!(idx.cached_prefix(&keys), 1);
        // Everything gone: no counts left behind; a clear starts without gaps.
        idx.apply(&removed(&[1, 3, 4])).unwrap();
        assert!(idx.is_empty());
        idx.apply(&KvCacheEvent::AllBlocksCleared).unwrap();
        assert!(!idx.gaps);
        // Stored again: the same block under a new engine hash moves, and counts once.
        idx.apply(&stored(&[7, 8], None, &prompt[..4], 2)).unwrap();
        idx.apply(&stored(&[9], Some(7), &prompt[2..4], 2)).unwrap();
        let children: u32 = idx.blocks.iter().map(|(_, b)| b.children).sum();
        assert_eq!(children, 1);
        assert_eq!(idx.cached_prefix(&keys), 2);
    }

    #[test]
    fn a_changed_block_size_is_a_fault_and_the_cap_holds() {
        let mut idx = index(3);
        idx.apply(&stored(&[1], None, &[1, 2], 2)).unwrap();
        assert_eq!(
            idx.apply(&stored(&[2], None, &[1, 2, 3, 4], 4)),
            Err(IndexFault::BlockSizeChanged { before: 2, now: 4 })
        );
        // A shorter block is a partial page: skipped, not a fault.
        assert_eq!(idx.apply(&stored(&[3], None, &[1], 1)).unwrap().partial, 1);
        idx.clear();
        for i in 0..1000u64 {
            idx.apply(&stored(&[i], None, &[i as u32, 0], 2)).unwrap();
        }
        assert_eq!(idx.len(), 3);
        assert!(
            idx.by_engine.len() <= 3,
            "removals resolve only what is indexed"
        );
        // The newest survive.
        assert_eq!(idx.cached_prefix(&prompt_keys(&[999, 0], 2)), 1);
        assert_eq!(idx.cached_prefix(&prompt_keys(&[0, 0], 2)), 0);
        // Remembered removals stay under the cap too.
        for i in 0..1000u64 {
            idx.apply(&stored(&[i], None, &[i as u32, 1], 2)).unwrap();
            idx.apply(&removed(&[i])).unwrap();
        }
        assert_eq!(idx.removed_at.len(), 3);
    }

    #[test]
    fn a_reporting_index_keeps_the_fleets_first_block_map_true() {
        use super::super::first_blocks::{FirstBlockSink, FirstBlocks};
        use std::sync::Arc;
        let map = Arc::new(FirstBlocks::default());
        let mut idx = BlockIndex::reporting(
            NonZeroUsize::new(3).unwrap(),
            FirstBlockSink::new(map.clone()),
        );
        let id = idx.first_block_id().unwrap();
        let first = |tokens: &[u32]| prompt_keys(tokens, 2)[0];
        let holds = |tokens: &[u32]| map.holders(&first(tokens)).contains(&id);
        // Only a block without a parent is a prompt's first.
        idx.apply(&stored(&[1, 2], None, &[1, 2, 3, 4], 2)).unwrap();
        assert!(holds(&[1, 2]));
        assert_eq!(map.len(), 1);
        // Removed by its event, then stored again.
        idx.apply(&removed(&[1])).unwrap();
        assert!(!holds(&[1, 2]));
        idx.apply(&stored(&[5], None, &[1, 2], 2)).unwrap();
        assert!(holds(&[1, 2]));
        // Pushed out past the cap (3 blocks: 2 and 5 are older than 6, 7, 8).
        idx.apply(&stored(&[6, 7, 8], None, &[7, 7, 8, 8, 9, 9], 2))
            .unwrap();
        assert!(
            !holds(&[1, 2]),
            "the least recently stored first block was evicted"
        );
        assert!(holds(&[7, 7]));
        // A clear takes them all; so does the index going (its worker left).
        idx.apply(&KvCacheEvent::AllBlocksCleared).unwrap();
        assert!(map.is_empty());
        idx.apply(&stored(&[9], None, &[3, 3], 2)).unwrap();
        assert!(holds(&[3, 3]));
        drop(idx);
        assert!(map.is_empty());
    }
}
