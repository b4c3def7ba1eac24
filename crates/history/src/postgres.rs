//! The store in PostgreSQL (`--history-backend postgres`): one database that every gateway
//! replica shares, with the same tables, records, bounds and errors as [`crate::sqlite`].
//!
//! - Connections come from a pool ([`deadpool_postgres`]). A connection the server closed
//!   is noticed when it is next handed out and replaced by a fresh one, so when the
//!   database comes back the calls work again without reopening the store. A call dropped
//!   midway (its caller timed out) closes its connection instead of returning it.
//! - Opening connects once and brings the schema up to date, so an unreachable database
//!   at start is [`HistoryError::Open`] naming the url (the gateway refuses to start):
//!   a history that silently answers 503 from the first request would be harder to notice.
//! - Appends to one conversation, from any replica, take the conversation's row lock
//!   first: a turn's items stay contiguous and in order, and none is lost.
//! - TLS is not supported yet: connections are plain TCP (or a Unix socket), and a url
//!   that asks for `sslmode=require` fails to connect. Keep the database on a trusted
//!   network.
//!
//! JSON is kept as TEXT, not JSONB: JSONB reorders an object's keys, and clients get their
//! items back exactly as they were added.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
};
use serde_json::Value;
use tokio_postgres::NoTls;

use crate::records::{Conversation, Item, ItemPage, ListQuery, Metadata, StoredResponse};
use crate::HistoryError;

#[path = "postgres_sql.rs"]
mod sql;

pub use sql::SCHEMA_VERSION;

/// Most connections one store (one gateway) holds: history calls are short, and a
/// database serves a bounded number of connections to all replicas together.
pub const POOL_SIZE: usize = 16;

/// How long an idle connection waits before the kernel checks its peer: a connection to a
/// server that vanished without closing it is dropped instead of kept in the pool.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// One PostgreSQL database holding the history. Cheap to clone (a pool handle).
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
}

impl PostgresStore {
    /// Connects to `url`, brings its schema up to date and makes the pool; `timeout`
    /// bounds each connection attempt and each wait for a pooled one.
    pub async fn open(url: &str, timeout: Duration) -> Result<Self, HistoryError> {
        let open_error = |reason: String| HistoryError::Open {
            url: redact(url),
            reason,
        };
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| open_error(describe(&e)))?;
        config
            .connect_timeout(timeout)
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(Duration::from_secs(10))
            .keepalives_retries(3);
        if config.get_application_name().is_none() {
            config.application_name("pdserve");
        }
        // Migrations may wait for another replica's; give them longer than one call.
        let startup = timeout.max(Duration::from_secs(10));
        let (mut client, connection) = tokio::time::timeout(startup, config.connect(NoTls))
            .await
            .map_err(|_| open_error(format!("no answer within {} ms", startup.as_millis())))?
            .map_err(|e| open_error(describe(&e)))?;
        let mut connection = tokio::spawn(connection);
        let migrated = tokio::time::timeout(startup, sql::migrate(&mut client)).await;
        // Dropping the client says goodbye to the server; the connection task then ends.
        drop(client);
        if tokio::time::timeout(Duration::from_secs(1), &mut connection)
            .await
            .is_err()
        {
            connection.abort();
        }
        match migrated {
            Err(_) => {
                let reason = format!("the schema migration took over {} ms", startup.as_millis());
                return Err(open_error(reason));
            }
            Ok(Err(HistoryError::Unavailable(reason))) => return Err(open_error(reason)),
            Ok(result) => result?,
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            // Fast: a closed connection is still noticed (and replaced) when handed out,
            // without a round trip on every call.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|e| open_error(e.to_string()))?;
        tracing::info!(url = %redact(url), "history store opened (PostgreSQL)");
        Ok(Self { pool })
    }

    /// [`PostgresStore::open`] from synchronous code, inside a tokio runtime or not: it
    /// runs on a thread and runtime of its own (`block_on` on the caller's would panic),
    /// and blocks the caller until done.
    pub fn open_blocking(url: &str, timeout: Duration) -> Result<Self, HistoryError> {
        let owned = url.to_string();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| HistoryError::Open {
                    url: redact(&owned),
                    reason: e.to_string(),
                })?
                .block_on(Self::open(&owned, timeout))
        })
        .join()
        .unwrap_or_else(|_| {
            Err(HistoryError::Open {
                url: redact(url),
                reason: "opening panicked".into(),
            })
        })
    }

    async fn lease(&self) -> Result<Lease, HistoryError> {
        let client = self.pool.get().await.map_err(|e| {
            HistoryError::Unavailable(match &e {
                // Its own message leaves out why ("error connecting to server").
                PoolError::Backend(pg) => format!("cannot connect: {}", describe(pg)),
                other => other.to_string(),
            })
        })?;
        Ok(Lease(Some(client)))
    }

    /// Creates a conversation with `metadata` and its first `items`.
    pub async fn create_conversation(
        &self,
        metadata: &Metadata,
        items: Vec<Value>,
        now: i64,
    ) -> Result<(Conversation, Vec<Item>), HistoryError> {
        let mut c = self.lease().await?;
        let result = sql::create_conversation(&mut c, metadata, items, now).await;
        c.finish(result)
    }

    /// The conversation `id`.
    pub async fn conversation(&self, id: &str) -> Result<Option<Conversation>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::conversation(&c, id).await;
        c.finish(result)
    }

    /// Replaces conversation `id`'s metadata; `None` when there is no such conversation.
    pub async fn update_conversation(
        &self,
        id: &str,
        metadata: &Metadata,
    ) -> Result<Option<Conversation>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::update_conversation(&c, id, metadata).await;
        c.finish(result)
    }

    /// Deletes conversation `id` and its items; whether it existed.
    pub async fn delete_conversation(&self, id: &str) -> Result<bool, HistoryError> {
        let c = self.lease().await?;
        let result = sql::delete_conversation(&c, id).await;
        c.finish(result)
    }

    /// Adds `items` to conversation `id`, in order; `None` when there is no such
    /// conversation.
    pub async fn add_items(
        &self,
        id: &str,
        items: Vec<Value>,
        now: i64,
    ) -> Result<Option<Vec<Item>>, HistoryError> {
        let mut c = self.lease().await?;
        let result = sql::add_items(&mut c, id, items, now).await;
        c.finish(result)
    }

    /// A page of conversation `id`'s items; `None` when there is no such conversation.
    pub async fn list_items(
        &self,
        id: &str,
        query: &ListQuery,
    ) -> Result<Option<ItemPage>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::list_items(&c, id, query).await;
        c.finish(result)
    }

    /// Item `item` of conversation `id`.
    pub async fn item(&self, id: &str, item: &str) -> Result<Option<Item>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::item(&c, id, item).await;
        c.finish(result)
    }

    /// Deletes item `item` of conversation `id`; whether it was there.
    pub async fn delete_item(&self, id: &str, item: &str) -> Result<bool, HistoryError> {
        let c = self.lease().await?;
        let result = sql::delete_item(&c, id, item).await;
        c.finish(result)
    }

    /// Stores `response` and, when it was a turn of a conversation, appends its input
    /// and output items to it, all or nothing. A conversation deleted meanwhile is an
    /// error (the turn is not stored).
    pub async fn put_response(&self, response: &StoredResponse) -> Result<(), HistoryError> {
        let mut c = self.lease().await?;
        let result = sql::put_response(&mut c, response).await;
        c.finish(result)
    }

    /// The stored response `id`.
    pub async fn response(&self, id: &str) -> Result<Option<StoredResponse>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::response(&c, id).await;
        c.finish(result)
    }

    /// Deletes the stored response `id`; whether it existed.
    pub async fn delete_response(&self, id: &str) -> Result<bool, HistoryError> {
        let c = self.lease().await?;
        let result = sql::delete_response(&c, id).await;
        c.finish(result)
    }

    /// The chain that ends at response `id`, oldest first (at most
    /// [`crate::sqlite::MAX_CHAIN`] turns): `None` when `id` is not stored. A turn whose
    /// predecessor has expired starts it.
    pub async fn chain(&self, id: &str) -> Result<Option<Vec<StoredResponse>>, HistoryError> {
        let c = self.lease().await?;
        let result = sql::chain(&c, id).await;
        c.finish(result)
    }

    /// Deletes what is older than `before` (Unix seconds), then the oldest responses and
    /// conversations past `max_responses` and `max_conversations`; how many rows went.
    /// While another replica sweeps, this one deletes nothing (0): two sweeps deleting the
    /// same rows in different orders could deadlock, and one sweep is enough.
    pub async fn sweep(
        &self,
        before: Option<i64>,
        max_responses: Option<usize>,
        max_conversations: Option<usize>,
    ) -> Result<usize, HistoryError> {
        let mut c = self.lease().await?;
        let result = sql::sweep(&mut c, before, max_responses, max_conversations).await;
        c.finish(result)
    }
}

/// A pooled connection for one call. It goes back to the pool only through
/// [`Lease::finish`], once the call is over; dropped midway (the caller timed out) it is
/// closed instead, since it may still be inside a transaction holding the conversation's
/// lock, or owe answers the next call would read.
struct Lease(Option<Object>);

impl Lease {
    /// Gives the connection back to the pool; `result` is the call's.
    fn finish<T>(mut self, result: T) -> T {
        drop(self.0.take());
        result
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            tracing::debug!("history: a call was dropped midway; closing its connection");
            drop(Object::take(client));
        }
    }
}

impl Deref for Lease {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        self.0
            .as_ref()
            .expect("a lease holds its connection until dropped")
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut ClientWrapper {
        self.0
            .as_mut()
            .expect("a lease holds its connection until dropped")
    }
}

impl From<tokio_postgres::Error> for HistoryError {
    fn from(e: tokio_postgres::Error) -> Self {
        HistoryError::Unavailable(describe(&e))
    }
}

/// `e` with the server's own message, which `Display` leaves out ("db error").
fn describe(e: &tokio_postgres::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

/// `url` without its password, fit for errors and logs.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
#[path = "postgres_tests.rs"]
mod tests;
