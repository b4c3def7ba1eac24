//! What the gateway remembers of the Responses it relayed: for each stored response, the
//! worker that answered (and so holds it) and the conversation up to and including its
//! answer, so that a next turn's prefill worker, which never saw the conversation, can be
//! sent all of it. Bounded, least recently used first.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use lru::LruCache;
use serde_json::Value;

/// One turn's messages (its input items and the answer), after the turns before it.
#[derive(Debug)]
pub struct Conversation {
    /// The conversation before this turn.
    pub before: Option<Arc<Conversation>>,
    /// This turn's input items and the answer, as Responses input items.
    pub items: Vec<Value>,
}

impl Conversation {
    /// Every item from the first turn to this one, in order.
    pub fn items(&self) -> Vec<Value> {
        let mut turns = Vec::new();
        let mut at = Some(self);
        while let Some(turn) = at {
            turns.push(&turn.items);
            at = turn.before.as_deref();
        }
        turns.into_iter().rev().flatten().cloned().collect()
    }
}

/// A stored response as the gateway knows it.
#[derive(Debug, Clone)]
pub struct ChainRecord {
    /// The base URL of the worker that answered and stores it.
    pub owner: String,
    /// The chain's first response id: the session key every turn is routed by.
    pub root: String,
    /// The response this one continued.
    pub previous: Option<String>,
    /// The conversation, this response's answer included; `None` when the chain began
    /// on another gateway (only its worker holds the earlier turns).
    pub conversation: Option<Arc<Conversation>>,
}

/// Response id → [`ChainRecord`].
#[derive(Debug)]
pub struct ResponseChains {
    records: Mutex<LruCache<String, ChainRecord>>,
}

impl ResponseChains {
    /// A store of at most `capacity` responses.
    pub fn new(capacity: NonZeroUsize) -> Self {
        Self {
            records: Mutex::new(LruCache::new(capacity)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, ChainRecord>> {
        // A panic while holding the lock cannot leave the map inconsistent; keep serving.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The record of response `id` (refreshed as recently used).
    pub fn get(&self, id: &str) -> Option<ChainRecord> {
        self.lock().get(id).cloned()
    }

    /// Keeps `record` for response `id`.
    pub fn put(&self, id: String, record: ChainRecord) {
        self.lock().put(id, record);
    }

    /// Forgets response `id` (deleted on its worker).
    pub fn remove(&self, id: &str) {
        self.lock().pop(id);
    }

    /// How many responses are remembered.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_conversation_lists_its_turns_in_order() {
        let first = Arc::new(Conversation {
            before: None,
            items: vec![json!("u1"), json!("a1")],
        });
        let second = Conversation {
            before: Some(first.clone()),
            items: vec![json!("u2"), json!("a2")],
        };
        assert_eq!(
            second.items(),
            vec![json!("u1"), json!("a1"), json!("u2"), json!("a2")]
        );
        assert_eq!(first.items().len(), 2);
    }

    #[test]
    fn least_recently_used_records_go_first() {
        let chains = ResponseChains::new(NonZeroUsize::new(2).unwrap());
        let record = |owner: &str| ChainRecord {
            owner: owner.into(),
            root: "r".into(),
            previous: None,
            conversation: None,
        };
        chains.put("a".into(), record("w1"));
        chains.put("b".into(), record("w2"));
        assert_eq!(chains.get("a").unwrap().owner, "w1");
        chains.put("c".into(), record("w3"));
        assert!(chains.get("b").is_none(), "b was the least recently used");
        assert!(chains.get("a").is_some());
        chains.remove("a");
        assert!(chains.get("a").is_none());
        assert_eq!(chains.len(), 1);
    }
}
