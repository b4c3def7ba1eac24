//! Blocks pinned for a peer to read, each with a deadline after which they are freed.

use std::collections::HashMap;
use std::time::Instant;

/// Pinned entries by request id, each with an abort deadline.
#[derive(Debug)]
pub struct PinTable<T> {
    entries: HashMap<String, (T, Instant)>,
}

impl<T> Default for PinTable<T> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }
}

impl<T> PinTable<T> {
    /// Pins `entry` under `request_id` until `deadline`; returns an entry it replaced.
    pub fn insert(&mut self, request_id: String, entry: T, deadline: Instant) -> Option<T> {
        self.entries
            .insert(request_id, (entry, deadline))
            .map(|(e, _)| e)
    }

    /// The entry pinned under `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Option<&T> {
        self.entries.get(request_id).map(|(e, _)| e)
    }

    /// Unpins and returns the entry under `request_id`.
    pub fn remove(&mut self, request_id: &str) -> Option<T> {
        self.entries.remove(request_id).map(|(e, _)| e)
    }

    /// Unpins and returns every entry whose deadline is at or before `now`.
    pub fn remove_expired(&mut self, now: Instant) -> Vec<(String, T)> {
        let expired: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        expired
            .into_iter()
            .filter_map(|id| self.entries.remove(&id).map(|(e, _)| (id, e)))
            .collect()
    }

    /// Number of pinned entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Iterates over pinned entries.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.entries.values().map(|(e, _)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn expiry_and_removal() {
        let now = Instant::now();
        let mut t = PinTable::default();
        t.insert("a".into(), 1, now + Duration::from_secs(10));
        t.insert("b".into(), 2, now);
        assert_eq!(t.remove_expired(now), vec![("b".to_string(), 2)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.remove("a"), Some(1));
        assert!(t.remove("a").is_none());
        assert!(t.is_empty());
    }
}
