//! Paged KV block allocation: reference counts, a free list, prefix caching and pins.
//!
//! A block is *used* while something references it (a sequence, or a pin held for a KV
//! transfer). Released blocks whose content is known (a full block registered with
//! [`BlockManager::commit`]) stay findable by their chained [`BlockHash`] and sit in an
//! LRU; they are reclaimed, oldest first, only when no plain free block is left.
//!
//! Blocks may also be *kept* under a handle ([`BlockManager::keep`]): a hold that, unlike
//! a pin, does not stop the pool from reclaiming them. A decode worker keeps a finished
//! conversation's blocks this way for a next turn that may never come; a reader then
//! [`claims`](BlockManager::claim) them, which pins them if none was reclaimed meanwhile.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use lru::LruCache;
use pdserve_model::{BlockId, BLOCK_SIZE};

/// Content identity of a full block: a hash chained over all tokens from the start of the
/// sequence to the end of this block, so equal hashes mean equal prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The hash of a full block of `tokens` that follows the block hashed `parent`.
    pub fn of(parent: Option<BlockHash>, tokens: &[u32]) -> Self {
        // `DefaultHasher::new` uses fixed keys: the same build hashes the same way in
        // every process, which lets peers compare prefixes by hash.
        let mut h = DefaultHasher::new();
        parent.map(|p| p.0).hash(&mut h);
        tokens.hash(&mut h);
        BlockHash(h.finish())
    }
}

/// Errors from misusing block ids (a bug in the caller, reported instead of corrupting
/// the cache).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The id is outside the pool.
    #[error("block {0} does not exist")]
    UnknownBlock(BlockId),
    /// The block has no reference to drop or share.
    #[error("block {0} is not in use")]
    NotInUse(BlockId),
    /// The block has no pin to drop.
    #[error("block {0} is not pinned")]
    NotPinned(BlockId),
}

/// What is known about a full block's content, kept to verify hash hits exactly.
#[derive(Debug, Clone)]
struct CachedContent {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: [u32; BLOCK_SIZE],
}

#[derive(Debug, Default, Clone)]
struct BlockState {
    ref_count: u32,
    pins: u32,
    /// Keeps on the block (see [`BlockManager::keep`]); it stays reclaimable.
    keeps: u32,
    /// Bumped whenever the block is handed out: a keep taken under an older generation
    /// refers to content that is gone.
    generation: u64,
    cached: Option<CachedContent>,
}

/// A change to the prefix cache, recorded for KV-event subscribers (routers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheChange {
    /// A full block became findable.
    Stored {
        /// Its chained hash.
        hash: BlockHash,
        /// The hash of the block before it.
        parent: Option<BlockHash>,
        /// Its tokens.
        tokens: [u32; BLOCK_SIZE],
    },
    /// A block's content was forgotten (its block reclaimed).
    Removed {
        /// Its chained hash.
        hash: BlockHash,
    },
}

/// Blocks found in the prefix cache for a token sequence; each is referenced once more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// The cached blocks, in sequence order.
    pub blocks: Vec<BlockId>,
    /// Their chained hashes.
    pub hashes: Vec<BlockHash>,
}

impl PrefixHit {
    /// Tokens covered by the hit.
    pub fn num_tokens(&self) -> usize {
        self.blocks.len() * BLOCK_SIZE
    }
}

/// Allocator of the KV pool's blocks with prefix caching.
#[derive(Debug)]
pub struct BlockManager {
    blocks: Vec<BlockState>,
    /// Unreferenced blocks without cached content; handed out first.
    free: Vec<BlockId>,
    /// Unreferenced blocks with cached content, least recently released first.
    evictable: LruCache<BlockId, ()>,
    by_hash: HashMap<BlockHash, BlockId>,
    num_pinned: usize,
    /// Kept blocks by handle, each with the generation it was kept at.
    kept: HashMap<u64, Vec<(BlockId, u64)>>,
    /// Kept blocks reclaimed for new allocations so far.
    kept_reclaimed: u64,
    /// Prefix-cache changes not yet drained; `None` while nobody listens.
    changes: Option<Vec<CacheChange>>,
}

impl BlockManager {
    /// A manager of `num_blocks` free blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            blocks: vec![BlockState::default(); num_blocks],
            // Reversed so that low ids are handed out first (easier to read in logs).
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: LruCache::unbounded(),
            by_hash: HashMap::new(),
            num_pinned: 0,
            kept: HashMap::new(),
            kept_reclaimed: 0,
            changes: None,
        }
    }

    /// Starts recording prefix-cache changes for [`BlockManager::drain_changes`].
    pub fn record_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The prefix-cache changes since the last call, in the order they happened.
    pub fn drain_changes(&mut self) -> Vec<CacheChange> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now (plain free plus reclaimable cached ones).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by a sequence or a pin.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free()
    }

    /// Blocks findable in the prefix cache (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// Blocks held by at least one pin.
    pub fn num_pinned(&self) -> usize {
        self.num_pinned
    }

    /// Whether `id` is held by at least one pin.
    pub fn is_pinned(&self, id: BlockId) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.pins > 0)
    }

    /// References held on `id` (0 when free).
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.ref_count)
    }

    /// `n` fresh blocks, each referenced once, or `None` (and nothing taken) if fewer
    /// than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.num_free() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = match self.free.pop() {
                Some(id) => id,
                None => {
                    let (id, ()) = self.evictable.pop_lru()?;
                    self.uncache(id);
                    let block = &mut self.blocks[id as usize];
                    if block.keeps > 0 {
                        block.keeps = 0;
                        self.kept_reclaimed += 1;
                    }
                    id
                }
            };
            let block = &mut self.blocks[id as usize];
            block.ref_count = 1;
            block.generation = block.generation.wrapping_add(1);
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference from each block. Blocks are released in reverse so a
    /// sequence's tail is evicted before its head (heads are shared more often).
    pub fn release(&mut self, ids: &[BlockId]) -> Result<(), BlockError> {
        for &id in ids {
            self.check_in_use(id)?;
        }
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id as usize];
            block.ref_count -= 1;
            if block.ref_count == 0 {
                if block.cached.is_some() || block.keeps > 0 {
                    self.evictable.put(id, ());
                } else {
                    self.free.push(id);
                }
            }
        }
        Ok(())
    }

    /// Adds one reference to each block (sharing a block that is in use, or reviving an
    /// unreferenced cached one).
    pub fn retain(&mut self, ids: &[BlockId]) -> Result<(), BlockError> {
        for &id in ids {
            let block = self
                .blocks
                .get(id as usize)
                .ok_or(BlockError::UnknownBlock(id))?;
            if block.ref_count == 0 && block.cached.is_none() && block.keeps == 0 {
                return Err(BlockError::NotInUse(id));
            }
        }
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            if block.ref_count == 0 {
                self.evictable.pop(&id);
            }
            block.ref_count += 1;
        }
        Ok(())
    }

    /// Holds blocks in use on behalf of a KV transfer (a reference that no sequence owns).
    pub fn pin(&mut self, ids: &[BlockId]) -> Result<(), BlockError> {
        self.retain(ids)?;
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            if block.pins == 0 {
                self.num_pinned += 1;
            }
            block.pins += 1;
        }
        Ok(())
    }

    /// Drops a pin taken with [`BlockManager::pin`].
    pub fn unpin(&mut self, ids: &[BlockId]) -> Result<(), BlockError> {
        for &id in ids {
            let block = self
                .blocks
                .get(id as usize)
                .ok_or(BlockError::UnknownBlock(id))?;
            if block.pins == 0 {
                return Err(BlockError::NotPinned(id));
            }
        }
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            block.pins -= 1;
            if block.pins == 0 {
                self.num_pinned -= 1;
            }
        }
        self.release(ids)
    }

    /// Keeps blocks in use under `handle` (replacing what it kept before): once nothing
    /// references them they sit in the reclaimable LRU instead of the free list, so they
    /// survive until the pool needs the space.
    pub fn keep(&mut self, handle: u64, ids: &[BlockId]) -> Result<(), BlockError> {
        for &id in ids {
            self.check_in_use(id)?;
        }
        self.forget(handle);
        let mut kept = Vec::with_capacity(ids.len());
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            block.keeps += 1;
            kept.push((id, block.generation));
        }
        self.kept.insert(handle, kept);
        Ok(())
    }

    /// Pins the blocks kept under `handle` and ends the keep, or `None` (the keep ended
    /// too) when the handle is unknown or any of its blocks was reclaimed meanwhile.
    pub fn claim(&mut self, handle: u64) -> Option<Vec<BlockId>> {
        let kept = self.kept.remove(&handle)?;
        let intact = kept
            .iter()
            .all(|&(id, generation)| self.blocks[id as usize].generation == generation);
        if intact {
            let ids: Vec<BlockId> = kept.iter().map(|&(id, _)| id).collect();
            // Cannot fail: every block is referenced or kept.
            self.pin(&ids).expect("kept blocks can be pinned");
            self.drop_keeps(&kept);
            return Some(ids);
        }
        self.drop_keeps(&kept);
        None
    }

    /// Ends the keep under `handle`; false when there was none.
    pub fn forget(&mut self, handle: u64) -> bool {
        match self.kept.remove(&handle) {
            Some(kept) => {
                self.drop_keeps(&kept);
                true
            }
            None => false,
        }
    }

    /// Kept blocks reclaimed for new allocations so far.
    pub fn kept_reclaimed(&self) -> u64 {
        self.kept_reclaimed
    }

    /// Handles with blocks kept.
    pub fn num_keeps(&self) -> usize {
        self.kept.len()
    }

    fn drop_keeps(&mut self, kept: &[(BlockId, u64)]) {
        for &(id, generation) in kept {
            let block = &mut self.blocks[id as usize];
            // A reclaimed block's keeps were cleared when it was handed out again.
            if block.generation != generation || block.keeps == 0 {
                continue;
            }
            block.keeps -= 1;
            if block.keeps == 0 && block.ref_count == 0 && block.cached.is_none() {
                self.evictable.pop(&id);
                self.free.push(id);
            }
        }
    }

    /// The longest cached prefix of `tokens`, referenced once more. At least one token is
    /// always left uncovered: a sequence needs one computed token to produce logits.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixHit {
        let max_blocks = tokens.len().saturating_sub(1) / BLOCK_SIZE;
        let mut hit = PrefixHit::default();
        let mut parent = None;
        for chunk in tokens.chunks_exact(BLOCK_SIZE).take(max_blocks) {
            let hash = BlockHash::of(parent, chunk);
            let Some(&id) = self.by_hash.get(&hash) else {
                break;
            };
            let verified = self.blocks[id as usize]
                .cached
                .as_ref()
                .is_some_and(|c| c.parent == parent && c.tokens[..] == *chunk);
            if !verified {
                break;
            }
            hit.blocks.push(id);
            hit.hashes.push(hash);
            parent = Some(hash);
        }
        // Referencing cannot fail: every hit block is cached.
        self.retain(&hit.blocks)
            .expect("prefix-cache hits are cached blocks");
        hit
    }

    /// Records that block `id` (in use) now holds the full block `tokens` following the
    /// block hashed `parent`, making it findable by later prompts. Returns its hash. If an
    /// equal block is already cached, `id` stays uncached (the first copy wins).
    pub fn commit(
        &mut self,
        id: BlockId,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> Result<BlockHash, BlockError> {
        self.check_in_use(id)?;
        let hash = BlockHash::of(parent, tokens);
        let block = &mut self.blocks[id as usize];
        if block.cached.is_none() && !self.by_hash.contains_key(&hash) {
            let mut content = [0u32; BLOCK_SIZE];
            content.copy_from_slice(&tokens[..BLOCK_SIZE]);
            block.cached = Some(CachedContent {
                hash,
                parent,
                tokens: content,
            });
            self.by_hash.insert(hash, id);
            if let Some(changes) = &mut self.changes {
                changes.push(CacheChange::Stored {
                    hash,
                    parent,
                    tokens: content,
                });
            }
        }
        Ok(hash)
    }

    fn check_in_use(&self, id: BlockId) -> Result<(), BlockError> {
        match self.blocks.get(id as usize) {
            None => Err(BlockError::UnknownBlock(id)),
            Some(b) if b.ref_count == 0 => Err(BlockError::NotInUse(id)),
            Some(_) => Ok(()),
        }
    }

    fn uncache(&mut self, id: BlockId) {
        if let Some(content) = self.blocks[id as usize].cached.take() {
            self.by_hash.remove(&content.hash);
            if let Some(changes) = &mut self.changes {
                changes.push(CacheChange::Removed { hash: content.hash });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32).map(|i| i * 7 + salt).collect()
    }

    /// Allocates blocks for `tokens` after a prefix hit and commits every full block, as
    /// the scheduler does once a prompt is computed.
    fn run_sequence(bm: &mut BlockManager, tokens: &[u32]) -> (PrefixHit, Vec<BlockId>) {
        let hit = bm.match_prefix(tokens);
        let total = tokens.len().div_ceil(BLOCK_SIZE);
        let mut blocks = hit.blocks.clone();
        blocks.extend(bm.allocate(total - blocks.len()).unwrap());
        let mut parent = None;
        for (i, chunk) in tokens.chunks_exact(BLOCK_SIZE).enumerate() {
            parent = Some(bm.commit(blocks[i], parent, chunk).unwrap());
        }
        (hit, blocks)
    }

    #[test]
    fn allocate_and_release_account_for_every_block() {
        let mut bm = BlockManager::new(4);
        let a = bm.allocate(3).unwrap();
        assert_eq!((bm.num_used(), bm.num_free()), (3, 1));
        assert!(bm.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(bm.num_free(), 1);
        bm.release(&a).unwrap();
        assert_eq!((bm.num_used(), bm.num_free()), (0, 4));
        assert_eq!(bm.release(&a[..1]), Err(BlockError::NotInUse(a[0])));
        assert_eq!(bm.release(&[9]), Err(BlockError::UnknownBlock(9)));
    }

    #[test]
    fn repeated_prompt_hits_its_full_blocks_only() {
        let mut bm = BlockManager::new(16);
        let p = prompt(40, 1); // 2 full blocks + 8 tokens
        let (hit, blocks) = run_sequence(&mut bm, &p);
        assert!(hit.blocks.is_empty());
        bm.release(&blocks).unwrap();
        assert_eq!(bm.num_used(), 0);
        assert_eq!(bm.num_cached(), 2);

        let (hit, blocks2) = run_sequence(&mut bm, &p);
        assert_eq!(hit.num_tokens(), 32);
        assert_eq!(&blocks2[..2], &blocks[..2], "same physical blocks reused");
        bm.release(&blocks2).unwrap();

        // A prompt that shares only the first block.
        let mut other = p.clone();
        other[20] += 1;
        let (hit, b3) = run_sequence(&mut bm, &other);
        assert_eq!(hit.blocks, vec![blocks[0]]);
        bm.release(&b3).unwrap();
    }

    #[test]
    fn exact_block_multiple_leaves_one_token_to_compute() {
        let mut bm = BlockManager::new(8);
        let p = prompt(32, 3);
        let (_, blocks) = run_sequence(&mut bm, &p);
        bm.release(&blocks).unwrap();
        let hit = bm.match_prefix(&p);
        assert_eq!(hit.blocks.len(), 1, "last block is recomputed for logits");
        bm.release(&hit.blocks).unwrap();
    }

    #[test]
    fn shared_blocks_are_counted_once_and_freed_last() {
        let mut bm = BlockManager::new(8);
        let p = prompt(33, 5);
        let (_, a) = run_sequence(&mut bm, &p);
        let (hit, b) = run_sequence(&mut bm, &p);
        assert_eq!(hit.blocks.len(), 2);
        assert_eq!(bm.ref_count(a[0]), 2);
        assert_eq!(bm.num_used(), 4, "2 shared + 1 tail each");
        bm.release(&a).unwrap();
        assert_eq!(bm.num_used(), 3);
        bm.release(&b).unwrap();
        assert_eq!(bm.num_used(), 0);
    }

    #[test]
    fn cached_blocks_are_reclaimed_lru_when_free_runs_out() {
        let mut bm = BlockManager::new(4);
        let first = prompt(17, 1);
        let second = prompt(17, 2);
        let (_, a) = run_sequence(&mut bm, &first);
        bm.release(&a).unwrap();
        let (_, b) = run_sequence(&mut bm, &second);
        bm.release(&b).unwrap();
        assert_eq!(bm.num_cached(), 2);
        // Plain free blocks go first: the two cached ones survive.
        let x = bm.allocate(2).unwrap();
        assert_eq!(bm.num_cached(), 2);
        // Then the least recently released cached block (first prompt's) is evicted.
        let y = bm.allocate(1).unwrap();
        assert_eq!(bm.num_cached(), 1);
        assert!(bm.match_prefix(&first).blocks.is_empty());
        let hit = bm.match_prefix(&second);
        assert_eq!(hit.blocks.len(), 1);
        assert!(bm.allocate(1).is_none(), "the hit block is in use again");
        for ids in [x, y, hit.blocks] {
            bm.release(&ids).unwrap();
        }
        assert_eq!(bm.num_used(), 0);
    }

    #[test]
    fn duplicate_content_keeps_the_first_copy() {
        let mut bm = BlockManager::new(4);
        let p = prompt(16, 9);
        let a = bm.allocate(1).unwrap();
        let b = bm.allocate(1).unwrap();
        let ha = bm.commit(a[0], None, &p).unwrap();
        let hb = bm.commit(b[0], None, &p).unwrap();
        assert_eq!(ha, hb);
        assert_eq!(bm.num_cached(), 1);
        bm.release(&b).unwrap();
        bm.release(&a).unwrap();
        let hit = bm.match_prefix(&[p.clone(), vec![1]].concat());
        assert_eq!(hit.blocks, a);
        bm.release(&hit.blocks).unwrap();
    }

    #[test]
    fn pinned_blocks_outlive_their_sequence() {
        let mut bm = BlockManager::new(4);
        let a = bm.allocate(2).unwrap();
        bm.pin(&a).unwrap();
        assert_eq!(bm.num_pinned(), 2);
        bm.release(&a).unwrap();
        assert_eq!(bm.num_used(), 2, "the pin keeps them");
        bm.unpin(&a).unwrap();
        assert_eq!((bm.num_used(), bm.num_pinned()), (0, 0));
        assert_eq!(bm.unpin(&a), Err(BlockError::NotPinned(a[0])));
        assert_eq!(bm.pin(&a), Err(BlockError::NotInUse(a[0])));
    }

    #[test]
    fn cache_changes_are_recorded_once_listened_for() {
        let mut bm = BlockManager::new(3);
        let p = prompt(17, 6);
        let (_, a) = run_sequence(&mut bm, &p);
        assert!(bm.drain_changes().is_empty(), "nobody listens yet");
        bm.release(&a).unwrap();
        bm.record_changes();
        let q = prompt(33, 7);
        let (_, b) = run_sequence(&mut bm, &q);
        let changes = bm.drain_changes();
        // The first prompt's cached block was reclaimed, the second's two were stored.
        let first = BlockHash::of(None, &p[..BLOCK_SIZE]);
        let h0 = BlockHash::of(None, &q[..BLOCK_SIZE]);
        let h1 = BlockHash::of(Some(h0), &q[BLOCK_SIZE..2 * BLOCK_SIZE]);
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert_eq!(changes[0], CacheChange::Removed { hash: first });
        assert!(matches!(changes[1], CacheChange::Stored { hash, parent: None, .. } if hash == h0));
        assert!(
            matches!(changes[2], CacheChange::Stored { hash, parent: Some(p), tokens } if hash == h1 && p == h0 && tokens[..] == q[BLOCK_SIZE..2 * BLOCK_SIZE])
        );
        assert!(bm.drain_changes().is_empty(), "drained");
        // Hitting cached content again is not news.
        bm.release(&b).unwrap();
        let (_, again) = run_sequence(&mut bm, &q);
        assert!(bm.drain_changes().is_empty());
        bm.release(&again).unwrap();
    }

    #[test]
    fn kept_blocks_survive_until_the_pool_needs_them() {
        let mut bm = BlockManager::new(4);
        let p = prompt(20, 4); // one full block (cached) and a partial one (not)
        let (_, seq) = run_sequence(&mut bm, &p);
        bm.pin(&seq).unwrap(); // as a finishing pin_on_finish sequence
        bm.release(&seq).unwrap();
        bm.keep(7, &seq).unwrap();
        bm.unpin(&seq).unwrap();
        assert_eq!((bm.num_pinned(), bm.num_used(), bm.num_free()), (0, 0, 4));
        // Plain free blocks go first: the kept ones are intact and can be claimed.
        let other = bm.allocate(2).unwrap();
        assert_eq!(bm.claim(7), Some(seq.clone()));
        assert_eq!(bm.num_pinned(), 2);
        assert_eq!(bm.claim(7), None, "claimed once");
        bm.unpin(&seq).unwrap();
        bm.release(&other).unwrap();
        assert_eq!(bm.num_free(), 4);

        // Kept again, then the pool runs out: they are reclaimed and the claim is refused.
        let (_, seq) = run_sequence(&mut bm, &p);
        bm.keep(8, &seq).unwrap();
        bm.release(&seq).unwrap();
        let all = bm.allocate(4).unwrap();
        assert_eq!(bm.kept_reclaimed(), 2);
        assert_eq!(bm.claim(8), None);
        assert_eq!(bm.num_keeps(), 0);
        bm.release(&all).unwrap();

        // A forgotten keep puts its uncached block back on the free list at once.
        let (_, seq) = run_sequence(&mut bm, &p);
        bm.keep(9, &seq).unwrap();
        bm.release(&seq).unwrap();
        assert!(bm.forget(9) && !bm.forget(9));
        assert_eq!(
            bm.evictable.len(),
            1,
            "only the cached full block stays in the LRU"
        );
        assert_eq!((bm.num_used(), bm.num_free()), (0, 4));
    }
}
