//! Which workers hold each prompt's first block, for the whole fleet in one map, kept by
//! the workers' indexes as their events come.
//!
//! A worker holds none of a prompt unless it holds the prompt's first block (its index
//! keeps a block only under a held parent). So a routing decision reads this map once and
//! looks into the indexes of the workers it names, not of every candidate: a new prompt
//! probes no index at all, where a fleet of 128 cost 128 look-ups into tables too large
//! for the cache.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::keys::BlockKey;

/// A worker index's number in [`FirstBlocks`] (one per index, never reused).
pub type IndexId = u32;

/// The indexes holding one first block, in no order.
type Holders = SmallVec<[IndexId; 2]>;

/// First block key → the indexes holding it.
#[derive(Debug, Default)]
pub struct FirstBlocks {
    holders: Mutex<HashMap<BlockKey, Holders, foldhash::fast::FixedState>>,
    next_id: AtomicU32,
}

impl FirstBlocks {
    /// A number for a new index.
    fn next_id(&self) -> IndexId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<BlockKey, Holders, foldhash::fast::FixedState>> {
        // Each change is one push or one removal: a panic elsewhere cannot tear it.
        self.holders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The indexes holding first block `key`, sorted (for binary search).
    pub fn holders(&self, key: &BlockKey) -> SmallVec<[IndexId; 4]> {
        let mut holders: SmallVec<[IndexId; 4]> = match self.lock().get(key) {
            Some(h) => h.iter().copied().collect(),
            None => SmallVec::new(),
        };
        holders.sort_unstable();
        holders
    }

    /// First blocks held anywhere (a test and metrics aid).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no index holds a first block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One index's handle on the fleet's map: what it adds and drops goes there under its
/// number.
#[derive(Debug)]
pub struct FirstBlockSink {
    map: Arc<FirstBlocks>,
    id: IndexId,
}

impl FirstBlockSink {
    /// A handle for a new index of `map`.
    pub fn new(map: Arc<FirstBlocks>) -> Self {
        let id = map.next_id();
        Self { map, id }
    }

    /// The index's number.
    pub fn id(&self) -> IndexId {
        self.id
    }

    /// The index now holds first block `key`.
    pub(super) fn add(&self, key: BlockKey) {
        let mut map = self.map.lock();
        let holders = map.entry(key).or_default();
        if !holders.contains(&self.id) {
            holders.push(self.id);
        }
    }

    /// The index no longer holds the first blocks `keys`.
    pub(super) fn remove(&self, keys: impl IntoIterator<Item = BlockKey>) {
        let mut map = self.map.lock();
        for key in keys {
            if let Some(holders) = map.get_mut(&key) {
                holders.retain(|h| *h != self.id);
                if holders.is_empty() {
                    map.remove(&key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_index_adds_and_removes_only_its_own_holding() {
        let map = Arc::new(FirstBlocks::default());
        let (a, b) = (
            FirstBlockSink::new(map.clone()),
            FirstBlockSink::new(map.clone()),
        );
        assert_ne!(a.id(), b.id());
        a.add(BlockKey(1));
        a.add(BlockKey(1));
        b.add(BlockKey(1));
        b.add(BlockKey(2));
        assert_eq!(map.holders(&BlockKey(1)).as_slice(), &[a.id(), b.id()]);
        a.remove([BlockKey(1), BlockKey(2)]);
        assert_eq!(map.holders(&BlockKey(1)).as_slice(), &[b.id()]);
        assert_eq!(map.holders(&BlockKey(2)).as_slice(), &[b.id()]);
        b.remove([BlockKey(1), BlockKey(2)]);
        assert!(map.is_empty(), "an entry goes with its last holder");
        assert!(map.holders(&BlockKey(3)).is_empty());
    }
}
