//! The open database behind a [`crate::HistoryStore`], whichever it is: each operation
//! goes to SQLite on tokio's blocking pool (its calls block) or to PostgreSQL as it is
//! (its calls are async). Bounding them in time is the store's job, not this one's.

use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::postgres::PostgresStore;
use crate::records::{Conversation, Item, ItemPage, ListQuery, Metadata, StoredResponse};
use crate::sqlite::SqliteStore;
use crate::HistoryError;

/// An open database.
#[derive(Clone)]
pub(crate) enum Backend {
    /// SQLite (a file, or this process's memory): one connection, one call at a time.
    Sqlite(Arc<Mutex<SqliteStore>>),
    /// PostgreSQL: a pool of connections.
    Postgres(PostgresStore),
}

/// Runs `op` on the SQLite database on the blocking pool.
async fn blocking<T: Send + 'static>(
    db: &Arc<Mutex<SqliteStore>>,
    op: impl FnOnce(&mut SqliteStore) -> Result<T, HistoryError> + Send + 'static,
) -> Result<T, HistoryError> {
    let db = db.clone();
    tokio::task::spawn_blocking(move || {
        let mut db = db.lock().unwrap_or_else(|e| e.into_inner());
        op(&mut db)
    })
    .await
    .map_err(|join| HistoryError::Unavailable(join.to_string()))?
}

impl Backend {
    pub(crate) async fn create_conversation(
        &self,
        metadata: Metadata,
        items: Vec<Value>,
        now: i64,
    ) -> Result<(Conversation, Vec<Item>), HistoryError> {
        match self {
            Backend::Sqlite(db) => {
                blocking(db, move |db| db.create_conversation(&metadata, items, now)).await
            }
            Backend::Postgres(db) => db.create_conversation(&metadata, items, now).await,
        }
    }

    pub(crate) async fn conversation(
        &self,
        id: String,
    ) -> Result<Option<Conversation>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.conversation(&id)).await,
            Backend::Postgres(db) => db.conversation(&id).await,
        }
    }

    pub(crate) async fn update_conversation(
        &self,
        id: String,
        metadata: Metadata,
    ) -> Result<Option<Conversation>, HistoryError> {
        match self {
            Backend::Sqlite(db) => {
                blocking(db, move |db| db.update_conversation(&id, &metadata)).await
            }
            Backend::Postgres(db) => db.update_conversation(&id, &metadata).await,
        }
    }

    pub(crate) async fn delete_conversation(&self, id: String) -> Result<bool, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.delete_conversation(&id)).await,
            Backend::Postgres(db) => db.delete_conversation(&id).await,
        }
    }

    pub(crate) async fn add_items(
        &self,
        id: String,
        items: Vec<Value>,
        now: i64,
    ) -> Result<Option<Vec<Item>>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.add_items(&id, items, now)).await,
            Backend::Postgres(db) => db.add_items(&id, items, now).await,
        }
    }

    pub(crate) async fn list_items(
        &self,
        id: String,
        query: ListQuery,
    ) -> Result<Option<ItemPage>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.list_items(&id, &query)).await,
            Backend::Postgres(db) => db.list_items(&id, &query).await,
        }
    }

    pub(crate) async fn item(
        &self,
        id: String,
        item: String,
    ) -> Result<Option<Item>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.item(&id, &item)).await,
            Backend::Postgres(db) => db.item(&id, &item).await,
        }
    }

    pub(crate) async fn delete_item(&self, id: String, item: String) -> Result<bool, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.delete_item(&id, &item)).await,
            Backend::Postgres(db) => db.delete_item(&id, &item).await,
        }
    }

    pub(crate) async fn put_response(&self, response: StoredResponse) -> Result<(), HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.put_response(&response)).await,
            Backend::Postgres(db) => db.put_response(&response).await,
        }
    }

    pub(crate) async fn response(
        &self,
        id: String,
    ) -> Result<Option<StoredResponse>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.response(&id)).await,
            Backend::Postgres(db) => db.response(&id).await,
        }
    }

    pub(crate) async fn delete_response(&self, id: String) -> Result<bool, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.delete_response(&id)).await,
            Backend::Postgres(db) => db.delete_response(&id).await,
        }
    }

    pub(crate) async fn chain(
        &self,
        id: String,
    ) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
        match self {
            Backend::Sqlite(db) => blocking(db, move |db| db.chain(&id)).await,
            Backend::Postgres(db) => db.chain(&id).await,
        }
    }

    pub(crate) async fn sweep(
        &self,
        before: Option<i64>,
        max_responses: Option<usize>,
        max_conversations: Option<usize>,
    ) -> Result<usize, HistoryError> {
        match self {
            Backend::Sqlite(db) => {
                blocking(db, move |db| {
                    db.sweep(before, max_responses, max_conversations)
                })
                .await
            }
            Backend::Postgres(db) => db.sweep(before, max_responses, max_conversations).await,
        }
    }
}
