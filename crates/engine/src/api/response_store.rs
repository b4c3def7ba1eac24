//! Stored responses (`store`, default true): the response object `GET /v1/responses/{id}`
//! answers, and the conversation a `previous_response_id` continues. Bounded; the least
//! recently used response goes first.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;
use pdserve_model::ChatTurn;
use serde_json::Value;

/// Responses kept at most.
pub const STORED_RESPONSES: usize = 4096;

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object as answered.
    pub body: Value,
    /// The conversation up to and including this response's output (instructions
    /// left out: they do not carry over to the next turn).
    pub turns: Vec<ChatTurn>,
    /// The chain's first response id: the session key of every turn (an orchestrator
    /// sends a session's prefills to the same prefill worker).
    pub root: String,
}

/// The worker's stored responses.
#[derive(Debug)]
pub struct ResponseStore {
    entries: Mutex<LruCache<String, StoredResponse>>,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(STORED_RESPONSES)
    }
}

impl ResponseStore {
    /// A store of at most `capacity` responses (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Self {
            entries: Mutex::new(LruCache::new(capacity)),
        }
    }

    /// Keeps `response` under `id`.
    pub fn put(&self, id: String, response: StoredResponse) {
        self.lock().put(id, response);
    }

    /// The response stored under `id` (now the most recently used).
    pub fn get(&self, id: &str) -> Option<StoredResponse> {
        self.lock().get(id).cloned()
    }

    /// Forgets `id`; whether it was stored.
    pub fn remove(&self, id: &str) -> bool {
        self.lock().pop(id).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, StoredResponse>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_response_goes_first() {
        let store = ResponseStore::new(2);
        let stored = |n: i64| StoredResponse {
            body: Value::from(n),
            turns: Vec::new(),
            root: String::new(),
        };
        store.put("a".into(), stored(1));
        store.put("b".into(), stored(2));
        assert!(store.get("a").is_some());
        store.put("c".into(), stored(3));
        assert!(store.get("b").is_none(), "b was the least recently used");
        assert_eq!(store.get("a").unwrap().body, 1);
        assert!(store.remove("a"));
        assert!(!store.remove("a"));
    }
}
