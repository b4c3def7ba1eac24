//! KV-cache events for routers, in vLLM's wire format: every block that enters the
//! prefix cache (computed here or imported over KV transfer) and every block reclaimed
//! from it, published on a ZeroMQ PUB socket, with a ROUTER socket that replays
//! missed batches (`--kv-events-config`).
//!
//! The scheduler records [`CacheChange`]s in its block manager and hands them over after
//! each step through a bounded queue ([`EventSink`]); a task on the async runtime turns
//! them into `KVEventBatch`es, numbers them and sends them, so the scheduler thread never
//! waits on a socket.

mod config;
mod publisher;

pub use config::KvEventsConfig;
pub use publisher::{Publisher, PublisherError};

use pdserve_model::BLOCK_SIZE;
use pdserve_protocol::kv_events::{EngineBlockHash, KvCacheEvent};
use tokio::sync::mpsc;

use crate::block_manager::CacheChange;

/// What the scheduler sends the publisher: one step's changes, or the start-up clear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheNews {
    /// The cache starts empty (sent once, first).
    Cleared,
    /// Changes of one step, in order.
    Changes(Vec<CacheChange>),
}

/// The scheduler's end of the queue to the publisher.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::Sender<CacheNews>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl EventSink {
    /// Hands `news` to the publisher without waiting; a full queue drops it (counted:
    /// subscribers then see a sequence gap and re-sync).
    pub fn send(&self, news: CacheNews) {
        if self.tx.try_send(news).is_err() {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The wire events for one step's changes: consecutive stores of one chain become one
/// `BlockStored` (as vLLM sends a request's new blocks), consecutive removals one
/// `BlockRemoved`.
pub fn to_events(changes: &[CacheChange]) -> Vec<KvCacheEvent> {
    let hash = |h: crate::block_manager::BlockHash| EngineBlockHash::Int(h.0);
    let mut events: Vec<KvCacheEvent> = Vec::new();
    let mut last_stored = None;
    for change in changes {
        match change {
            CacheChange::Stored {
                hash: h,
                parent,
                tokens,
            } => {
                if let (
                    Some(prev),
                    Some(KvCacheEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        ..
                    }),
                ) = (last_stored, events.last_mut())
                {
                    if *parent == Some(prev) {
                        block_hashes.push(hash(*h));
                        token_ids.extend_from_slice(tokens);
                        last_stored = Some(*h);
                        continue;
                    }
                }
                events.push(KvCacheEvent::BlockStored {
                    block_hashes: vec![hash(*h)],
                    parent_block_hash: parent.map(hash),
                    token_ids: tokens.to_vec(),
                    block_size: BLOCK_SIZE as u32,
                    lora_id: None,
                    // One tier: the engine's KV pool (there is no offload tier to tell
                    // apart).
                    medium: None,
                    lora_name: None,
                });
                last_stored = Some(*h);
            }
            CacheChange::Removed { hash: h } => {
                last_stored = None;
                if let Some(KvCacheEvent::BlockRemoved { block_hashes, .. }) = events.last_mut() {
                    block_hashes.push(hash(*h));
                    continue;
                }
                events.push(KvCacheEvent::BlockRemoved {
                    block_hashes: vec![hash(*h)],
                    medium: None,
                });
            }
        }
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_manager::BlockHash;

    #[test]
    fn chained_stores_merge_and_removals_group() {
        let tokens = |v: u32| [v; BLOCK_SIZE];
        let (a, b, c) = (BlockHash(1), BlockHash(2), BlockHash(3));
        let events = to_events(&[
            CacheChange::Stored {
                hash: a,
                parent: None,
                tokens: tokens(1),
            },
            CacheChange::Stored {
                hash: b,
                parent: Some(a),
                tokens: tokens(2),
            },
            // Another chain: a new event.
            CacheChange::Stored {
                hash: c,
                parent: None,
                tokens: tokens(3),
            },
            CacheChange::Removed { hash: a },
            CacheChange::Removed { hash: b },
        ]);
        assert_eq!(events.len(), 3, "{events:?}");
        let KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            ..
        } = &events[0]
        else {
            panic!("{events:?}");
        };
        assert_eq!(
            block_hashes,
            &[EngineBlockHash::Int(1), EngineBlockHash::Int(2)]
        );
        assert_eq!(parent_block_hash, &None);
        assert_eq!(token_ids.len(), 2 * BLOCK_SIZE);
        assert_eq!(*block_size as usize, BLOCK_SIZE);
        assert!(
            matches!(&events[2], KvCacheEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 2)
        );
    }
}
