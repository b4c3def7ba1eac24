//! The PostgreSQL store's SQL: the schema and its migrations, and one function per
//! operation on a pooled connection ([`super::PostgresStore`] hands them one). Every write
//! that must be seen whole is one transaction, and every append to a conversation locks
//! its row first.

use deadpool_postgres::{ClientWrapper, Transaction};
use serde_json::Value;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::records::{
    ensure_item_id, new_id, Conversation, Item, ItemPage, ListQuery, Metadata, Order,
    StoredResponse,
};
use crate::sqlite::MAX_CHAIN;
use crate::HistoryError;

/// The schema this build writes; a database with a newer one is refused.
pub const SCHEMA_VERSION: i64 = 1;

/// Schema migrations, from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 0 → 1. `seq` is the order rows were added in: a conversation's items are listed by
    // it, and the size bounds delete by it among rows of the same second.
    "CREATE TABLE conversations (
         id TEXT PRIMARY KEY,
         seq BIGINT GENERATED ALWAYS AS IDENTITY,
         created_at BIGINT NOT NULL,
         metadata TEXT NOT NULL
     );
     CREATE INDEX conversations_by_age ON conversations (created_at, seq);
     CREATE TABLE conversation_items (
         seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
         conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
         id TEXT NOT NULL,
         response_id TEXT,
         created_at BIGINT NOT NULL,
         body TEXT NOT NULL,
         UNIQUE (conversation_id, id)
     );
     CREATE INDEX conversation_items_in_order ON conversation_items (conversation_id, seq);
     CREATE TABLE responses (
         id TEXT PRIMARY KEY,
         seq BIGINT GENERATED ALWAYS AS IDENTITY,
         previous_response_id TEXT,
         conversation_id TEXT,
         created_at BIGINT NOT NULL,
         input TEXT NOT NULL,
         response TEXT NOT NULL,
         kv_route TEXT
     );
     CREATE INDEX responses_by_age ON responses (created_at, seq);",
];

/// Advisory lock keys (any constants no other program uses on the same database): one
/// migration at a time when replicas start together, one sweep at a time across them.
const MIGRATION_LOCK: i64 = 0x7064_7365_7276_0001;
pub(super) const SWEEP_LOCK: i64 = 0x7064_7365_7276_0002;

/// Creates a conversation with `metadata` and its first `items`.
pub(super) async fn create_conversation(
    c: &mut ClientWrapper,
    metadata: &Metadata,
    items: Vec<Value>,
    now: i64,
) -> Result<(Conversation, Vec<Item>), HistoryError> {
    let conversation = Conversation {
        id: new_id("conv"),
        created_at: now,
        metadata: metadata.clone(),
    };
    let text = serde_json::to_string(&conversation.metadata)?;
    let tx = c.transaction().await?;
    tx.execute(
        "INSERT INTO conversations (id, created_at, metadata) VALUES ($1, $2, $3)",
        &[&conversation.id, &now, &text],
    )
    .await?;
    let items = insert_items(&tx, &conversation.id, items, None, now).await?;
    tx.commit().await?;
    Ok((conversation, items))
}

/// The conversation `id`.
pub(super) async fn conversation(
    c: &ClientWrapper,
    id: &str,
) -> Result<Option<Conversation>, HistoryError> {
    let sql = "SELECT created_at, metadata FROM conversations WHERE id = $1";
    let row = query_opt(c, sql, &[&id]).await?;
    row.map(|row| read_conversation(id, &row)).transpose()
}

/// Replaces conversation `id`'s metadata; `None` when there is no such conversation.
pub(super) async fn update_conversation(
    c: &ClientWrapper,
    id: &str,
    metadata: &Metadata,
) -> Result<Option<Conversation>, HistoryError> {
    let text = serde_json::to_string(metadata)?;
    let row = c
        .query_opt(
            "UPDATE conversations SET metadata = $2 WHERE id = $1
             RETURNING created_at, metadata",
            &[&id, &text],
        )
        .await?;
    row.map(|row| read_conversation(id, &row)).transpose()
}

/// Deletes conversation `id` and its items; whether it existed.
pub(super) async fn delete_conversation(c: &ClientWrapper, id: &str) -> Result<bool, HistoryError> {
    let deleted = c
        .execute("DELETE FROM conversations WHERE id = $1", &[&id])
        .await?;
    Ok(deleted > 0)
}

/// Adds `items` to conversation `id`, in order; `None` when there is no such
/// conversation.
pub(super) async fn add_items(
    c: &mut ClientWrapper,
    id: &str,
    items: Vec<Value>,
    now: i64,
) -> Result<Option<Vec<Item>>, HistoryError> {
    let tx = c.transaction().await?;
    if !lock_conversation(&tx, id).await? {
        return Ok(None);
    }
    let items = insert_items(&tx, id, items, None, now).await?;
    tx.commit().await?;
    Ok(Some(items))
}

/// A page of conversation `id`'s items; `None` when there is no such conversation.
pub(super) async fn list_items(
    c: &ClientWrapper,
    id: &str,
    query: &ListQuery,
) -> Result<Option<ItemPage>, HistoryError> {
    let found = query_opt(c, "SELECT 1 FROM conversations WHERE id = $1", &[&id]).await?;
    if found.is_none() {
        return Ok(None);
    }
    let after = match &query.after {
        Some(item) => {
            let sql = "SELECT seq FROM conversation_items
                       WHERE conversation_id = $1 AND id = $2";
            let row = query_opt(c, sql, &[&id, item])
                .await?
                .ok_or_else(|| HistoryError::UnknownCursor(item.clone()))?;
            Some(row.try_get::<_, i64>(0)?)
        }
        None => None,
    };
    let sql = match query.order {
        Order::Asc => {
            "SELECT id, response_id, body FROM conversation_items
             WHERE conversation_id = $1 AND seq > $2 ORDER BY seq ASC LIMIT $3"
        }
        Order::Desc => {
            "SELECT id, response_id, body FROM conversation_items
             WHERE conversation_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3"
        }
    };
    let bound = after.unwrap_or(match query.order {
        Order::Asc => i64::MIN,
        Order::Desc => i64::MAX,
    });
    // One more than asked for: whether more follow, exactly.
    let fetch = query.limit as i64 + 1;
    let statement = c.prepare_cached(sql).await?;
    let mut items = c
        .query(&statement, &[&id, &bound, &fetch])
        .await?
        .iter()
        .map(read_item)
        .collect::<Result<Vec<_>, _>>()?;
    let has_more = items.len() > query.limit;
    items.truncate(query.limit);
    Ok(Some(ItemPage { items, has_more }))
}

/// Item `item` of conversation `id`.
pub(super) async fn item(
    c: &ClientWrapper,
    id: &str,
    item: &str,
) -> Result<Option<Item>, HistoryError> {
    let sql = "SELECT id, response_id, body FROM conversation_items
               WHERE conversation_id = $1 AND id = $2";
    let row = query_opt(c, sql, &[&id, &item]).await?;
    row.as_ref().map(read_item).transpose()
}

/// Deletes item `item` of conversation `id`; whether it was there.
pub(super) async fn delete_item(
    c: &ClientWrapper,
    id: &str,
    item: &str,
) -> Result<bool, HistoryError> {
    let deleted = c
        .execute(
            "DELETE FROM conversation_items WHERE conversation_id = $1 AND id = $2",
            &[&id, &item],
        )
        .await?;
    Ok(deleted > 0)
}

/// Stores `response` and, when it was a turn of a conversation, appends its input
/// and output items to it, all or nothing. A conversation deleted meanwhile is an
/// error (the turn is not stored).
pub(super) async fn put_response(
    c: &mut ClientWrapper,
    response: &StoredResponse,
) -> Result<(), HistoryError> {
    let input = serde_json::to_string(&response.input)?;
    let body = serde_json::to_string(&response.response)?;
    let kv_route = response
        .kv_route
        .as_ref()
        .map(serde_json::to_string)
        .transpose()?;
    let tx = c.transaction().await?;
    if let Some(conversation) = &response.conversation_id {
        if !lock_conversation(&tx, conversation).await? {
            return Err(HistoryError::ConversationGone(conversation.clone()));
        }
    }
    let statement = tx
        .prepare_cached(
            "INSERT INTO responses (id, previous_response_id, conversation_id,
                 created_at, input, response, kv_route)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .await?;
    tx.execute(
        &statement,
        &[
            &response.id,
            &response.previous_response_id,
            &response.conversation_id,
            &response.created_at,
            &input,
            &body,
            &kv_route,
        ],
    )
    .await?;
    if let Some(conversation) = &response.conversation_id {
        let items = response.input.iter().cloned().chain(response.output());
        let (id, at) = (Some(response.id.as_str()), response.created_at);
        insert_items(&tx, conversation, items.collect(), id, at).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The stored response `id`.
pub(super) async fn response(
    c: &ClientWrapper,
    id: &str,
) -> Result<Option<StoredResponse>, HistoryError> {
    let sql = "SELECT id, previous_response_id, conversation_id, created_at, input,
                      response, kv_route
               FROM responses WHERE id = $1";
    let row = query_opt(c, sql, &[&id]).await?;
    row.as_ref().map(read_response).transpose()
}

/// Deletes the stored response `id`; whether it existed.
pub(super) async fn delete_response(c: &ClientWrapper, id: &str) -> Result<bool, HistoryError> {
    let deleted = c
        .execute("DELETE FROM responses WHERE id = $1", &[&id])
        .await?;
    Ok(deleted > 0)
}

/// The chain that ends at response `id`, oldest first (at most [`MAX_CHAIN`] turns): `None`
/// when `id` is not stored. A turn whose predecessor has expired starts it.
pub(super) async fn chain(
    c: &ClientWrapper,
    id: &str,
) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
    let statement = c
        .prepare_cached(
            "WITH RECURSIVE chain (id, previous, depth) AS (
                 SELECT id, previous_response_id, 0::BIGINT FROM responses
                 WHERE id = $1
                 UNION ALL
                 SELECT r.id, r.previous_response_id, c.depth + 1
                 FROM responses r JOIN chain c ON r.id = c.previous
                 WHERE c.depth + 1 < $2
             )
             SELECT r.id, r.previous_response_id, r.conversation_id, r.created_at,
                    r.input, r.response, r.kv_route
             FROM chain c JOIN responses r ON r.id = c.id
             ORDER BY c.depth DESC",
        )
        .await?;
    let turns = c
        .query(&statement, &[&id, &(MAX_CHAIN as i64)])
        .await?
        .iter()
        .map(read_response)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((!turns.is_empty()).then_some(turns))
}

/// Deletes what is older than `before` (Unix seconds), then the oldest responses and
/// conversations past `max_responses` and `max_conversations`; how many rows went.
/// While another replica sweeps, this one deletes nothing (0): two sweeps deleting the
/// same rows in different orders could deadlock, and one sweep is enough.
pub(super) async fn sweep(
    c: &mut ClientWrapper,
    before: Option<i64>,
    max_responses: Option<usize>,
    max_conversations: Option<usize>,
) -> Result<usize, HistoryError> {
    let tx = c.transaction().await?;
    let row = tx
        .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&SWEEP_LOCK])
        .await?;
    if !row.try_get::<_, bool>(0)? {
        return Ok(0);
    }
    let mut gone = 0;
    if let Some(before) = before {
        gone += tx
            .execute("DELETE FROM responses WHERE created_at < $1", &[&before])
            .await?;
        gone += tx
            .execute(
                "DELETE FROM conversations c
                 WHERE c.created_at < $1 AND NOT EXISTS (
                     SELECT 1 FROM conversation_items i
                     WHERE i.conversation_id = c.id AND i.created_at >= $1)",
                &[&before],
            )
            .await?;
    }
    if let Some(max) = max_responses {
        gone += tx
            .execute(
                "DELETE FROM responses WHERE id IN (
                     SELECT id FROM responses ORDER BY created_at DESC, seq DESC
                     OFFSET $1)",
                &[&(max as i64)],
            )
            .await?;
    }
    if let Some(max) = max_conversations {
        gone += tx
            .execute(
                "DELETE FROM conversations WHERE id IN (
                     SELECT id FROM conversations ORDER BY created_at DESC, seq DESC
                     OFFSET $1)",
                &[&(max as i64)],
            )
            .await?;
    }
    tx.commit().await?;
    Ok(gone as usize)
}

/// Brings the schema to [`SCHEMA_VERSION`], refusing a newer one, in one transaction that
/// holds the migration lock: replicas starting together migrate one after the other.
pub(super) async fn migrate(client: &mut tokio_postgres::Client) -> Result<(), HistoryError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS pdserve_schema (version BIGINT NOT NULL)")
        .await?;
    let version: i64 = tx
        .query_one("SELECT COALESCE(MAX(version), 0) FROM pdserve_schema", &[])
        .await?
        .try_get(0)?;
    if version > SCHEMA_VERSION {
        return Err(HistoryError::NewerSchema {
            found: version,
            known: SCHEMA_VERSION,
        });
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    for (from, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        tx.batch_execute(migration).await?;
        tracing::info!(version = from + 1, "history schema migrated (PostgreSQL)");
    }
    tx.execute("DELETE FROM pdserve_schema", &[]).await?;
    tx.execute(
        "INSERT INTO pdserve_schema (version) VALUES ($1)",
        &[&SCHEMA_VERSION],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Locks conversation `id`'s row until the transaction ends; whether it exists. Every
/// append takes it first, so appends to one conversation run one at a time.
async fn lock_conversation(tx: &Transaction<'_>, id: &str) -> Result<bool, HistoryError> {
    let statement = tx
        .prepare_cached("SELECT 1 FROM conversations WHERE id = $1 FOR UPDATE")
        .await?;
    Ok(tx.query_opt(&statement, &[&id]).await?.is_some())
}

/// Inserts `items` into conversation `id` in order, giving each without an `id` one.
async fn insert_items(
    tx: &Transaction<'_>,
    id: &str,
    items: Vec<Value>,
    response_id: Option<&str>,
    now: i64,
) -> Result<Vec<Item>, HistoryError> {
    let statement = tx
        .prepare_cached(
            "INSERT INTO conversation_items (conversation_id, id, response_id, created_at, body)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .await?;
    let mut added = Vec::with_capacity(items.len());
    for mut body in items {
        let item_id = ensure_item_id(&mut body);
        let text = serde_json::to_string(&body)?;
        let inserted = tx
            .execute(&statement, &[&id, &item_id, &response_id, &now, &text])
            .await;
        match inserted {
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
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

/// Runs `sql`, prepared once per connection (the read paths of every turn: one round trip
/// instead of two); its row, if any.
async fn query_opt(
    c: &ClientWrapper,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, HistoryError> {
    let statement = c.prepare_cached(sql).await?;
    Ok(c.query_opt(&statement, params).await?)
}

fn read_conversation(id: &str, row: &Row) -> Result<Conversation, HistoryError> {
    let metadata: String = row.try_get(1)?;
    Ok(Conversation {
        id: id.to_string(),
        created_at: row.try_get(0)?,
        metadata: serde_json::from_str(&metadata)?,
    })
}

fn read_item(row: &Row) -> Result<Item, HistoryError> {
    let body: String = row.try_get(2)?;
    Ok(Item {
        id: row.try_get(0)?,
        response_id: row.try_get(1)?,
        body: serde_json::from_str(&body)?,
    })
}

fn read_response(row: &Row) -> Result<StoredResponse, HistoryError> {
    let input: String = row.try_get(4)?;
    let response: String = row.try_get(5)?;
    let kv_route: Option<String> = row.try_get(6)?;
    Ok(StoredResponse {
        id: row.try_get(0)?,
        previous_response_id: row.try_get(1)?,
        conversation_id: row.try_get(2)?,
        created_at: row.try_get(3)?,
        input: serde_json::from_str(&input)?,
        response: serde_json::from_str(&response)?,
        kv_route: kv_route.map(|r| serde_json::from_str(&r)).transpose()?,
    })
}
