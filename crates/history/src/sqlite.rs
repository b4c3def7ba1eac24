//! The store in SQLite: a file (`--history-backend sqlite`), or a database in this
//! process's memory (`memory`), the same schema and bounds either way.
//!
//! Every write that must be seen whole (a conversation with its first items, a response
//! with the items it adds to its conversation) is one transaction: a process killed
//! mid-write leaves nothing half-written visible.

use std::path::Path;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use serde_json::Value;

use crate::records::{
    ensure_item_id, new_id, Conversation, Item, ItemPage, ListQuery, Metadata, Order,
    StoredResponse,
};
use crate::HistoryError;

/// The schema this build writes; a database with a newer one is refused.
pub const SCHEMA_VERSION: i64 = 1;

/// Schema migrations, from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 0 → 1
    "CREATE TABLE conversations (
         id TEXT PRIMARY KEY,
         created_at INTEGER NOT NULL,
         metadata TEXT NOT NULL
     );
     CREATE INDEX conversations_by_age ON conversations (created_at);
     -- seq orders a conversation's items as they were added (one batch keeps its order).
     CREATE TABLE conversation_items (
         seq INTEGER PRIMARY KEY AUTOINCREMENT,
         conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
         id TEXT NOT NULL,
         response_id TEXT,
         created_at INTEGER NOT NULL,
         body TEXT NOT NULL,
         UNIQUE (conversation_id, id)
     );
     CREATE TABLE responses (
         id TEXT PRIMARY KEY,
         previous_response_id TEXT,
         conversation_id TEXT,
         created_at INTEGER NOT NULL,
         input TEXT NOT NULL,
         response TEXT NOT NULL,
         kv_route TEXT
     );
     CREATE INDEX responses_by_age ON responses (created_at);",
];

/// Deepest `previous_response_id` chain walked (also the guard against a cycle).
pub const MAX_CHAIN: usize = 1000;

/// One SQLite database holding the history.
pub struct SqliteStore {
    conn: Connection,
}

impl SqliteStore {
    /// Opens (creating) the database at `path` and brings its schema up to date.
    pub fn open(path: &Path) -> Result<Self, HistoryError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| HistoryError::Open {
                url: path.display().to_string(),
                reason: e.to_string(),
            })?;
        }
        let conn = Connection::open(path)?;
        // Readers and one writer at once, and a commit that survives a crash of this
        // process without waiting for the disk on every write.
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        Self::ready(conn)
    }

    /// A database in this process's memory.
    pub fn in_memory() -> Result<Self, HistoryError> {
        Self::ready(Connection::open_in_memory()?)
    }

    fn ready(mut conn: Connection) -> Result<Self, HistoryError> {
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn)?;
        Ok(Self { conn })
    }

    /// Creates a conversation with `metadata` and its first `items`.
    pub fn create_conversation(
        &mut self,
        metadata: &Metadata,
        items: Vec<Value>,
        now: i64,
    ) -> Result<(Conversation, Vec<Item>), HistoryError> {
        let conversation = Conversation {
            id: new_id("conv"),
            created_at: now,
            metadata: metadata.clone(),
        };
        let tx = self.conn.transaction()?;
        tx.execute(
            "INSERT INTO conversations (id, created_at, metadata) VALUES (?1, ?2, ?3)",
            params![
                conversation.id,
                now,
                serde_json::to_string(&conversation.metadata)?
            ],
        )?;
        let items = insert_items(&tx, &conversation.id, items, None, now)?;
        tx.commit()?;
        Ok((conversation, items))
    }

    /// The conversation `id`.
    pub fn conversation(&self, id: &str) -> Result<Option<Conversation>, HistoryError> {
        self.conn
            .query_row(
                "SELECT created_at, metadata FROM conversations WHERE id = ?1",
                [id],
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?)),
            )
            .optional()?
            .map(|(created_at, metadata)| {
                Ok(Conversation {
                    id: id.to_string(),
                    created_at,
                    metadata: serde_json::from_str(&metadata)?,
                })
            })
            .transpose()
    }

    /// Replaces conversation `id`'s metadata; `None` when there is no such conversation.
    pub fn update_conversation(
        &mut self,
        id: &str,
        metadata: &Metadata,
    ) -> Result<Option<Conversation>, HistoryError> {
        let changed = self.conn.execute(
            "UPDATE conversations SET metadata = ?2 WHERE id = ?1",
            params![id, serde_json::to_string(metadata)?],
        )?;
        if changed == 0 {
            return Ok(None);
        }
        self.conversation(id)
    }

    /// Deletes conversation `id` and its items; whether it existed.
    pub fn delete_conversation(&mut self, id: &str) -> Result<bool, HistoryError> {
        Ok(self
            .conn
            .execute("DELETE FROM conversations WHERE id = ?1", [id])?
            > 0)
    }

    /// Adds `items` to conversation `id`, in order; `None` when there is no such
    /// conversation.
    pub fn add_items(
        &mut self,
        id: &str,
        items: Vec<Value>,
        now: i64,
    ) -> Result<Option<Vec<Item>>, HistoryError> {
        let tx = self.conn.transaction()?;
        if !exists(&tx, id)? {
            return Ok(None);
        }
        let items = insert_items(&tx, id, items, None, now)?;
        tx.commit()?;
        Ok(Some(items))
    }

    /// A page of conversation `id`'s items; `None` when there is no such conversation.
    pub fn list_items(
        &self,
        id: &str,
        query: &ListQuery,
    ) -> Result<Option<ItemPage>, HistoryError> {
        if !exists(&self.conn, id)? {
            return Ok(None);
        }
        let after = match &query.after {
            Some(item) => Some(
                self.conn
                    .query_row(
                        "SELECT seq FROM conversation_items WHERE conversation_id = ?1 AND id = ?2",
                        [id, item],
                        |row| row.get::<_, i64>(0),
                    )
                    .optional()?
                    .ok_or_else(|| HistoryError::UnknownCursor(item.clone()))?,
            ),
            None => None,
        };
        let sql = match query.order {
            Order::Asc => {
                "SELECT id, response_id, body FROM conversation_items
                 WHERE conversation_id = ?1 AND seq > ?2 ORDER BY seq ASC LIMIT ?3"
            }
            Order::Desc => {
                "SELECT id, response_id, body FROM conversation_items
                 WHERE conversation_id = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT ?3"
            }
        };
        let bound = after.unwrap_or(match query.order {
            Order::Asc => i64::MIN,
            Order::Desc => i64::MAX,
        });
        // One more than asked for: whether more follow, exactly.
        let fetch = query.limit as i64 + 1;
        let mut statement = self.conn.prepare_cached(sql)?;
        let mut items = statement
            .query_map(params![id, bound, fetch], read_item)?
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .collect::<Result<Vec<_>, HistoryError>>()?;
        let has_more = items.len() > query.limit;
        items.truncate(query.limit);
        Ok(Some(ItemPage { items, has_more }))
    }

    /// Item `item` of conversation `id`.
    pub fn item(&self, id: &str, item: &str) -> Result<Option<Item>, HistoryError> {
        self.conn
            .query_row(
                "SELECT id, response_id, body FROM conversation_items
                 WHERE conversation_id = ?1 AND id = ?2",
                [id, item],
                read_item,
            )
            .optional()?
            .transpose()
    }

    /// Deletes item `item` of conversation `id`; whether it was there.
    pub fn delete_item(&mut self, id: &str, item: &str) -> Result<bool, HistoryError> {
        Ok(self.conn.execute(
            "DELETE FROM conversation_items WHERE conversation_id = ?1 AND id = ?2",
            [id, item],
        )? > 0)
    }

    /// Stores `response` and, when it was a turn of a conversation, appends its input
    /// and output items to it, all or nothing. A conversation deleted meanwhile is an
    /// error (the turn is not stored).
    pub fn put_response(&mut self, response: &StoredResponse) -> Result<(), HistoryError> {
        let tx = self.conn.transaction()?;
        tx.execute(
            "INSERT INTO responses
                 (id, previous_response_id, conversation_id, created_at, input, response, kv_route)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                response.id,
                response.previous_response_id,
                response.conversation_id,
                response.created_at,
                serde_json::to_string(&response.input)?,
                serde_json::to_string(&response.response)?,
                response
                    .kv_route
                    .as_ref()
                    .map(serde_json::to_string)
                    .transpose()?,
            ],
        )?;
        if let Some(conversation) = &response.conversation_id {
            if !exists(&tx, conversation)? {
                return Err(HistoryError::ConversationGone(conversation.clone()));
            }
            let items = response.input.iter().cloned().chain(response.output());
            insert_items(
                &tx,
                conversation,
                items.collect(),
                Some(&response.id),
                response.created_at,
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The stored response `id`.
    pub fn response(&self, id: &str) -> Result<Option<StoredResponse>, HistoryError> {
        self.conn
            .query_row(
                "SELECT id, previous_response_id, conversation_id, created_at, input, response,
                        kv_route
                 FROM responses WHERE id = ?1",
                [id],
                read_response,
            )
            .optional()?
            .transpose()
    }

    /// Deletes the stored response `id`; whether it existed.
    pub fn delete_response(&mut self, id: &str) -> Result<bool, HistoryError> {
        Ok(self
            .conn
            .execute("DELETE FROM responses WHERE id = ?1", [id])?
            > 0)
    }

    /// The chain that ends at response `id`, oldest first (at most [`MAX_CHAIN`] turns):
    /// `None` when `id` is not stored. A turn whose predecessor has expired starts it.
    pub fn chain(&self, id: &str) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
        let mut statement = self.conn.prepare_cached(
            "WITH RECURSIVE chain (id, previous, depth) AS (
                 SELECT id, previous_response_id, 0 FROM responses WHERE id = ?1
                 UNION ALL
                 SELECT r.id, r.previous_response_id, c.depth + 1
                 FROM responses r JOIN chain c ON r.id = c.previous
                 WHERE c.depth + 1 < ?2
             )
             SELECT r.id, r.previous_response_id, r.conversation_id, r.created_at, r.input,
                    r.response, r.kv_route
             FROM chain c JOIN responses r ON r.id = c.id
             ORDER BY c.depth DESC",
        )?;
        let turns = statement
            .query_map(params![id, MAX_CHAIN as i64], read_response)?
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .collect::<Result<Vec<_>, HistoryError>>()?;
        Ok((!turns.is_empty()).then_some(turns))
    }

    /// Deletes what is older than `before` (Unix seconds), then the oldest responses and
    /// conversations past `max_responses` and `max_conversations`; how many rows went.
    pub fn sweep(
        &mut self,
        before: Option<i64>,
        max_responses: Option<usize>,
        max_conversations: Option<usize>,
    ) -> Result<usize, HistoryError> {
        let tx = self.conn.transaction()?;
        let mut gone = 0;
        if let Some(before) = before {
            gone += tx.execute("DELETE FROM responses WHERE created_at < ?1", [before])?;
            gone += tx.execute(
                "DELETE FROM conversations WHERE id IN (
                     SELECT c.id FROM conversations c
                     WHERE c.created_at < ?1 AND NOT EXISTS (
                         SELECT 1 FROM conversation_items i
                         WHERE i.conversation_id = c.id AND i.created_at >= ?1))",
                [before],
            )?;
        }
        if let Some(max) = max_responses {
            gone += tx.execute(
                "DELETE FROM responses WHERE id IN (
                     SELECT id FROM responses ORDER BY created_at DESC, rowid DESC
                     LIMIT -1 OFFSET ?1)",
                [max as i64],
            )?;
        }
        if let Some(max) = max_conversations {
            gone += tx.execute(
                "DELETE FROM conversations WHERE id IN (
                     SELECT id FROM conversations ORDER BY created_at DESC, rowid DESC
                     LIMIT -1 OFFSET ?1)",
                [max as i64],
            )?;
        }
        tx.commit()?;
        Ok(gone)
    }
}

/// Brings the schema to [`SCHEMA_VERSION`], refusing a newer one.
fn migrate(conn: &mut Connection) -> Result<(), HistoryError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(HistoryError::NewerSchema {
            found: version,
            known: SCHEMA_VERSION,
        });
    }
    for (from, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let tx = conn.transaction()?;
        tx.execute_batch(migration)?;
        tx.pragma_update(None, "user_version", from as i64 + 1)?;
        tx.commit()?;
        tracing::info!(version = from + 1, "history schema migrated");
    }
    Ok(())
}

fn exists(conn: &Connection, id: &str) -> Result<bool, HistoryError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM conversations WHERE id = ?1",
            [id],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Inserts `items` into conversation `id` in order, giving each without an `id` one.
fn insert_items(
    tx: &Transaction<'_>,
    id: &str,
    items: Vec<Value>,
    response_id: Option<&str>,
    now: i64,
) -> Result<Vec<Item>, HistoryError> {
    let mut statement = tx.prepare_cached(
        "INSERT INTO conversation_items (conversation_id, id, response_id, created_at, body)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    let mut added = Vec::with_capacity(items.len());
    for mut body in items {
        let item_id = ensure_item_id(&mut body);
        let text = serde_json::to_string(&body)?;
        match statement.execute(params![id, item_id, response_id, now, text]) {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                return Err(HistoryError::DuplicateItem(item_id));
            }
            result => {
                result?;
            }
        }
        added.push(Item {
            id: item_id,
            response_id: response_id.map(str::to_string),
            body,
        });
    }
    Ok(added)
}

fn read_item(row: &rusqlite::Row<'_>) -> rusqlite::Result<Result<Item, HistoryError>> {
    let (id, response_id, body): (String, Option<String>, String) =
        (row.get(0)?, row.get(1)?, row.get(2)?);
    Ok(serde_json::from_str(&body)
        .map(|body| Item {
            id,
            response_id,
            body,
        })
        .map_err(HistoryError::from))
}

fn read_response(
    row: &rusqlite::Row<'_>,
) -> rusqlite::Result<Result<StoredResponse, HistoryError>> {
    let input: String = row.get(4)?;
    let response: String = row.get(5)?;
    let kv_route: Option<String> = row.get(6)?;
    let (id, previous_response_id, conversation_id, created_at) =
        (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?);
    Ok((|| -> Result<StoredResponse, HistoryError> {
        Ok(StoredResponse {
            id,
            previous_response_id,
            conversation_id,
            created_at,
            input: serde_json::from_str(&input)?,
            response: serde_json::from_str(&response)?,
            kv_route: kv_route.map(|r| serde_json::from_str(&r)).transpose()?,
        })
    })())
}

#[cfg(test)]
#[path = "sqlite_tests.rs"]
mod tests;
