//! [`HistoryStore`]: the history as the gateway uses it, whichever database holds it
//! (`backend.rs` sends each call to it). Every call is bounded by
//! `--history-timeout-ms`: past it the caller gets [`HistoryError::Unavailable`] (a 503
//! for the client) while a SQLite call finishes or fails on its own on the blocking pool,
//! and a PostgreSQL call is dropped (its connection closed).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::backend::Backend;
use crate::postgres::{redact, PostgresStore};
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
    /// A PostgreSQL database (`--history-url postgres://user@host:port/db`): survives
    /// restarts, shared by every gateway replica. No TLS yet.
    Postgres,
    /// Nothing is kept: `store` is ignored and requests that need history are refused.
    None,
}

/// How the history is kept.
#[derive(Clone)]
pub struct HistoryOptions {
    /// Which database.
    pub backend: HistoryBackend,
    /// Its location: a file path for SQLite, a `postgres://` url for PostgreSQL.
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

impl std::fmt::Debug for HistoryOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The url may carry a password.
        f.debug_struct("HistoryOptions")
            .field("backend", &self.backend)
            .field("url", &self.url.as_deref().map(redact))
            .field("retention", &self.retention)
            .field("max_responses", &self.max_responses)
            .field("max_conversations", &self.max_conversations)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// The gateway's history (see the module documentation). Cheap to clone.
#[derive(Clone)]
pub struct HistoryStore {
    db: Option<Backend>,
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
    /// Opens the history `options` describe (creating the database and its schema). For
    /// PostgreSQL it connects once, so an unreachable database fails here
    /// ([`HistoryError::Open`]) and not on the first request; it blocks up to the larger
    /// of the timeout and 10 s, on a thread of its own (safe inside a tokio runtime).
    pub fn open(options: HistoryOptions) -> Result<Self, HistoryError> {
        let sqlite = |db: SqliteStore| Some(Backend::Sqlite(Arc::new(Mutex::new(db))));
        let db = match options.backend {
            HistoryBackend::None => None,
            HistoryBackend::Memory => sqlite(SqliteStore::in_memory()?),
            HistoryBackend::Sqlite => {
                let url = options.url.as_deref().ok_or_else(|| HistoryError::Open {
                    url: String::new(),
                    reason: "--history-backend sqlite needs --history-url (a file path)".into(),
                })?;
                let path = PathBuf::from(url.strip_prefix("sqlite://").unwrap_or(url));
                sqlite(SqliteStore::open(&path).map_err(|e| match e {
                    HistoryError::Unavailable(reason) => HistoryError::Open {
                        url: url.to_string(),
                        reason,
                    },
                    other => other,
                })?)
            }
            HistoryBackend::Postgres => {
                let url = options.url.as_deref().ok_or_else(|| HistoryError::Open {
                    url: String::new(),
                    reason: "--history-backend postgres needs --history-url \
                             (postgres://user@host:port/database)"
                        .into(),
                })?;
                Some(Backend::Postgres(PostgresStore::open_blocking(
                    url,
                    options.timeout,
                )?))
            }
        };
        Ok(Self {
            db,
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

    /// Runs `op` on the database within the timeout.
    async fn run<'a, T, F>(&'a self, op: impl FnOnce(&'a Backend) -> F) -> Result<T, HistoryError>
    where
        F: Future<Output = Result<T, HistoryError>> + 'a,
    {
        let Some(db) = &self.db else {
            return Err(HistoryError::Unavailable(
                "the gateway keeps no history (--history-backend none)".into(),
            ));
        };
        match tokio::time::timeout(self.options.timeout, op(db)).await {
            Ok(result) => result,
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
        self.run(|db| db.create_conversation(metadata, items, now))
            .await
    }

    /// The conversation `id`.
    pub async fn conversation(&self, id: &str) -> Result<Option<Conversation>, HistoryError> {
        self.run(|db| db.conversation(id.to_string())).await
    }

    /// Replaces conversation `id`'s metadata.
    pub async fn update_conversation(
        &self,
        id: &str,
        metadata: Metadata,
    ) -> Result<Option<Conversation>, HistoryError> {
        self.run(|db| db.update_conversation(id.to_string(), metadata))
            .await
    }

    /// Deletes conversation `id`; whether it existed.
    pub async fn delete_conversation(&self, id: &str) -> Result<bool, HistoryError> {
        self.run(|db| db.delete_conversation(id.to_string())).await
    }

    /// Adds `items` to conversation `id`; `None` when there is none.
    pub async fn add_items(
        &self,
        id: &str,
        items: Vec<Value>,
    ) -> Result<Option<Vec<Item>>, HistoryError> {
        let now = unix_now();
        self.run(|db| db.add_items(id.to_string(), items, now))
            .await
    }

    /// A page of conversation `id`'s items; `None` when there is none.
    pub async fn list_items(
        &self,
        id: &str,
        query: ListQuery,
    ) -> Result<Option<ItemPage>, HistoryError> {
        self.run(|db| db.list_items(id.to_string(), query)).await
    }

    /// Item `item` of conversation `id`.
    pub async fn item(&self, id: &str, item: &str) -> Result<Option<Item>, HistoryError> {
        self.run(|db| db.item(id.to_string(), item.to_string()))
            .await
    }

    /// Deletes item `item` of conversation `id`; whether it was there.
    pub async fn delete_item(&self, id: &str, item: &str) -> Result<bool, HistoryError> {
        self.run(|db| db.delete_item(id.to_string(), item.to_string()))
            .await
    }

    /// Stores a finished turn (and appends its items to its conversation), all or nothing.
    pub async fn put_response(&self, response: StoredResponse) -> Result<(), HistoryError> {
        self.run(|db| db.put_response(response)).await
    }

    /// The stored response `id`.
    pub async fn response(&self, id: &str) -> Result<Option<StoredResponse>, HistoryError> {
        self.run(|db| db.response(id.to_string())).await
    }

    /// Deletes the stored response `id`; whether it existed.
    pub async fn delete_response(&self, id: &str) -> Result<bool, HistoryError> {
        self.run(|db| db.delete_response(id.to_string())).await
    }

    /// The chain ending at response `id`, oldest first; `None` when `id` is not stored.
    pub async fn chain(&self, id: &str) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
        self.run(|db| db.chain(id.to_string())).await
    }

    /// Deletes what retention and the size bounds no longer keep; how many rows went.
    pub async fn sweep(&self) -> Result<usize, HistoryError> {
        let options = &self.options;
        let before =
            (!options.retention.is_zero()).then(|| unix_now() - options.retention.as_secs() as i64);
        self.sweep_with(
            before,
            Some(options.max_responses),
            Some(options.max_conversations),
        )
        .await
    }

    /// Deletes what is older than `before` (Unix seconds), then the oldest past the
    /// bounds given; how many rows went ([`HistoryStore::sweep`] with explicit bounds).
    pub async fn sweep_with(
        &self,
        before: Option<i64>,
        max_responses: Option<usize>,
        max_conversations: Option<usize>,
    ) -> Result<usize, HistoryError> {
        self.run(|db| db.sweep(before, max_responses, max_conversations))
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
#[path = "store_tests.rs"]
pub(crate) mod tests;
