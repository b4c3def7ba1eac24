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
#[path = "block_manager_tests.rs"]
mod tests;
