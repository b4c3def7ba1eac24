//! `conversation_id` → the decode side's `kv_transfer_params` from the conversation's
//! last turn: single use, time-limited, bounded with least-recently-used eviction.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::LruCache;
use pdserve_protocol::KvTransferParams;

/// One cached handle and when it was stored.
#[derive(Debug)]
struct Entry {
    params: KvTransferParams,
    stored_at: Instant,
}

/// The conversation KV cache.
///
/// A handle is taken at most once: the decode worker's blocks are read by one prefill,
/// then the next turn's decode stores a fresh handle. Entries older than the TTL are
/// worthless (the decode worker has freed the blocks) and are never returned.
#[derive(Debug)]
pub struct ConversationCache {
    entries: Mutex<LruCache<String, Entry>>,
    ttl: Duration,
}

impl ConversationCache {
    /// A cache holding at most `capacity` conversations for `ttl` each.
    pub fn new(capacity: NonZeroUsize, ttl: Duration) -> Self {
        Self {
            entries: Mutex::new(LruCache::new(capacity)),
            ttl,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, Entry>> {
        // A panic while holding the lock cannot leave the map inconsistent; keep serving.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores the decode side's params for the conversation's next turn, replacing any.
    pub fn put(&self, conversation_id: &str, params: KvTransferParams) {
        let entry = Entry {
            params,
            stored_at: Instant::now(),
        };
        self.lock().put(conversation_id.to_string(), entry);
    }

    /// How long a handle is worth using.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Removes and returns the conversation's params if they are younger than the TTL.
    pub fn take(&self, conversation_id: &str) -> Option<KvTransferParams> {
        let entry = self.lock().pop(conversation_id)?;
        (entry.stored_at.elapsed() <= self.ttl).then_some(entry.params)
    }

    /// Drops expired entries and returns how many conversations remain.
    pub fn len(&self) -> usize {
        let mut entries = self.lock();
        // Entries are stored with increasing timestamps and a `take` removes rather than
        // refreshes, so the least recently used entries are also the oldest.
        while let Some((_, e)) = entries.peek_lru() {
            if e.stored_at.elapsed() <= self.ttl {
                break;
            }
            entries.pop_lru();
        }
        entries.len()
    }

    /// Whether no live conversation is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(id: &str) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            remote_request_id: Some(id.to_string()),
            ..KvTransferParams::default()
        }
    }

    #[test]
    fn single_use() {
        let c = ConversationCache::new(NonZeroUsize::new(4).unwrap(), Duration::from_secs(60));
        c.put("a", params("r1"));
        assert_eq!(c.len(), 1);
        assert_eq!(
            c.take("a").unwrap().remote_request_id.as_deref(),
            Some("r1")
        );
        assert!(c.take("a").is_none());
        assert!(c.is_empty());
    }

    #[test]
    fn expires_after_ttl() {
        let c = ConversationCache::new(NonZeroUsize::new(4).unwrap(), Duration::from_millis(20));
        c.put("a", params("r1"));
        c.put("b", params("r2"));
        std::thread::sleep(Duration::from_millis(40));
        assert!(c.take("a").is_none());
        assert_eq!(c.len(), 0, "expired entries are purged");
    }

    #[test]
    fn evicts_least_recently_used() {
        let c = ConversationCache::new(NonZeroUsize::new(2).unwrap(), Duration::from_secs(60));
        c.put("a", params("1"));
        c.put("b", params("2"));
        c.put("c", params("3"));
        assert!(c.take("a").is_none());
        assert!(c.take("b").is_some());
        assert!(c.take("c").is_some());
    }
}
