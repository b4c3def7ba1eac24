//! [`HistoryStore`]: the history as the gateway uses it, whichever database holds it.
//! SQLite calls block, so each runs on tokio's blocking pool, and every call is bounded by
//! `--history-timeout-ms`: past it the caller gets [`HistoryError::Unavailable`] (a 503
//! for the client) while the call finishes or fails on its own.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::records::{Conversation, Item, ItemPage, ListQuery, Metadata, StoredResponse};
use crate::sqlite::SqliteStore;
use crate::HistoryError;

/// Where the history lives (`--history-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HistoryBackend {
    /// In this process's memory: lost on restart, not shared between replicas, bounded
    /// like the others.
    Memory,
    /// A SQLite file (`--history-url`, a path): survives restarts; one machine.
    Sqlite,
    /// Nothing is kept: `store` is ignored and requests that need history are refused.
    None,
}

/// How the history is kept.
#[derive(Debug, Clone)]
pub struct HistoryOptions {
    /// Which database.
    pub backend: HistoryBackend,
    /// Its location: a file path for SQLite.
    pub url: Option<String>,
    /// Responses and conversations older than this are deleted (0: kept until the
    /// bounds below push them out).
    pub retention: Duration,
    /// Most stored responses; the oldest go first.
    pub max_responses: usize,
    /// Most conversations; the oldest go first.
    pub max_conversations: usize,
    /// Longest one call may take before it counts as unavailable.
    pub timeout: Duration,
}

/// The gateway's history (see the module documentation). Cheap to clone.
#[derive(Clone)]
pub struct HistoryStore {
    db: Option<Arc<Mutex<SqliteStore>>>,
    options: Arc<HistoryOptions>,
}

impl std::fmt::Debug for HistoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HistoryStore")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl HistoryStore {
    /// Opens the history `options` describe (creating the database and its schema).
    pub fn open(options: HistoryOptions) -> Result<Self, HistoryError> {
        let db = match options.backend {
            HistoryBackend::None => None,
            HistoryBackend::Memory => Some(SqliteStore::in_memory()?),
            HistoryBackend::Sqlite => {
                let url = options.url.as_deref().ok_or_else(|| HistoryError::Open {
                    url: String::new(),
                    reason: "--history-backend sqlite needs --history-url (a file path)".into(),
                })?;
                let path = PathBuf::from(url.strip_prefix("sqlite://").unwrap_or(url));
                Some(SqliteStore::open(&path).map_err(|e| match e {
                    HistoryError::Unavailable(reason) => HistoryError::Open {
                        url: url.to_string(),
                        reason,
                    },
                    other => other,
                })?)
            }
        };
        Ok(Self {
            db: db.map(|db| Arc::new(Mutex::new(db))),
            options: Arc::new(options),
        })
    }

    /// Whether anything is kept (`--history-backend none` keeps nothing).
    pub fn enabled(&self) -> bool {
        self.db.is_some()
    }

    /// Which database.
    pub fn backend(&self) -> HistoryBackend {
        self.options.backend
    }

    /// Runs `op` on the database, on the blocking pool, within the timeout.
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut SqliteStore) -> Result<T, HistoryError> + Send + 'static,
    ) -> Result<T, HistoryError> {
        let Some(db) = self.db.clone() else {
            return Err(HistoryError::Unavailable(
                "the gateway keeps no history (--history-backend none)".into(),
            ));
        };
        let call = tokio::task::spawn_blocking(move || {
            let mut db = db.lock().unwrap_or_else(|e| e.into_inner());
            op(&mut db)
        });
        match tokio::time::timeout(self.options.timeout, call).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(HistoryError::Unavailable(join.to_string())),
            Err(_) => Err(HistoryError::Unavailable(format!(
                "no answer within {} ms",
                self.options.timeout.as_millis()
            ))),
        }
    }

    /// Creates a conversation with `metadata` and its first `items`.
    pub async fn create_conversation(
        &self,
        metadata: Metadata,
        items: Vec<Value>,
    ) -> Result<(Conversation, Vec<Item>), HistoryError> {
        let now = unix_now();
        self.run(move |db| db.create_conversation(&metadata, items, now))
            .await
    }

    /// The conversation `id`.
    pub async fn conversation(&self, id: &str) -> Result<Option<Conversation>, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.conversation(&id)).await
    }

    /// Replaces conversation `id`'s metadata.
    pub async fn update_conversation(
        &self,
        id: &str,
        metadata: Metadata,
    ) -> Result<Option<Conversation>, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.update_conversation(&id, &metadata))
            .await
    }

    /// Deletes conversation `id`; whether it existed.
    pub async fn delete_conversation(&self, id: &str) -> Result<bool, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.delete_conversation(&id)).await
    }

    /// Adds `items` to conversation `id`; `None` when there is none.
    pub async fn add_items(
        &self,
        id: &str,
        items: Vec<Value>,
    ) -> Result<Option<Vec<Item>>, HistoryError> {
        let (id, now) = (id.to_string(), unix_now());
        self.run(move |db| db.add_items(&id, items, now)).await
    }

    /// A page of conversation `id`'s items; `None` when there is none.
    pub async fn list_items(
        &self,
        id: &str,
        query: ListQuery,
    ) -> Result<Option<ItemPage>, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.list_items(&id, &query)).await
    }

    /// Item `item` of conversation `id`.
    pub async fn item(&self, id: &str, item: &str) -> Result<Option<Item>, HistoryError> {
        let (id, item) = (id.to_string(), item.to_string());
        self.run(move |db| db.item(&id, &item)).await
    }

    /// Deletes item `item` of conversation `id`; whether it was there.
    pub async fn delete_item(&self, id: &str, item: &str) -> Result<bool, HistoryError> {
        let (id, item) = (id.to_string(), item.to_string());
        self.run(move |db| db.delete_item(&id, &item)).await
    }

    /// Stores a finished turn (and appends its items to its conversation), all or nothing.
    pub async fn put_response(&self, response: StoredResponse) -> Result<(), HistoryError> {
        self.run(move |db| db.put_response(&response)).await
    }

    /// The stored response `id`.
    pub async fn response(&self, id: &str) -> Result<Option<StoredResponse>, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.response(&id)).await
    }

    /// Deletes the stored response `id`; whether it existed.
    pub async fn delete_response(&self, id: &str) -> Result<bool, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.delete_response(&id)).await
    }

    /// The chain ending at response `id`, oldest first; `None` when `id` is not stored.
    pub async fn chain(&self, id: &str) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
        let id = id.to_string();
        self.run(move |db| db.chain(&id)).await
    }

    /// Deletes what retention and the size bounds no longer keep; how many rows went.
    pub async fn sweep(&self) -> Result<usize, HistoryError> {
        let options = self.options.clone();
        let before =
            (!options.retention.is_zero()).then(|| unix_now() - options.retention.as_secs() as i64);
        self.run(move |db| {
            db.sweep(
                before,
                Some(options.max_responses),
                Some(options.max_conversations),
            )
        })
        .await
    }
}

impl HistoryStore {
    /// Sweeps every `interval`, until dropped (the gateway's background task).
    pub async fn sweep_every(self, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            match self.sweep().await {
                Ok(0) => {}
                Ok(gone) => tracing::debug!(gone, "history swept"),
                Err(e) => tracing::warn!("history sweep failed: {e}"),
            }
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::records::Order;

    fn options(backend: HistoryBackend) -> HistoryOptions {
        HistoryOptions {
            backend,
            url: None,
            retention: Duration::ZERO,
            max_responses: 1000,
            max_conversations: 1000,
            timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn the_memory_backend_serves_every_call() {
        let store = HistoryStore::open(options(HistoryBackend::Memory)).unwrap();
        let mut metadata = Metadata::new();
        metadata.insert("topic".into(), "tests".into());
        let (conv, items) = store
            .create_conversation(
                metadata,
                vec![json!({"type": "message", "role": "user", "content": "hi"})],
            )
            .await
            .unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(
            store
                .conversation(&conv.id)
                .await
                .unwrap()
                .unwrap()
                .metadata["topic"],
            "tests"
        );
        let query = ListQuery {
            after: None,
            limit: 20,
            order: Order::Desc,
        };
        assert_eq!(
            store
                .list_items(&conv.id, query)
                .await
                .unwrap()
                .unwrap()
                .items
                .len(),
            1
        );
        assert!(store.delete_conversation(&conv.id).await.unwrap());
        assert!(store.conversation(&conv.id).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn no_backend_is_unavailable_and_sqlite_needs_a_path() {
        let none = HistoryStore::open(options(HistoryBackend::None)).unwrap();
        assert!(!none.enabled());
        let refused = none.response("resp_1").await.unwrap_err();
        assert!(
            refused.to_string().contains("--history-backend none"),
            "{refused}"
        );
        let missing = HistoryStore::open(options(HistoryBackend::Sqlite))
            .err()
            .unwrap();
        assert!(missing.to_string().contains("--history-url"), "{missing}");
    }

    #[tokio::test]
    async fn a_call_that_outlives_the_timeout_is_unavailable_not_a_hang() {
        let mut slow = options(HistoryBackend::Memory);
        slow.timeout = Duration::from_millis(50);
        let store = HistoryStore::open(slow).unwrap();
        // Hold the database, as a stuck call would.
        let db = store.db.clone().unwrap();
        let held = std::thread::spawn(move || {
            let _guard = db.lock().unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        std::thread::sleep(Duration::from_millis(20));
        let err = store.response("resp_1").await.unwrap_err();
        assert!(matches!(err, HistoryError::Unavailable(_)), "{err}");
        held.join().unwrap();
        // Once free again, it answers.
        assert!(store.response("resp_1").await.unwrap().is_none());
    }
}
