//! Durable conversation state for the gateway: stored Responses (`previous_response_id`
//! chains) and OpenAI Conversations with their items, kept where every gateway replica
//! and every restart finds them.
//!
//! - [`args`]: the `--history-*` flags;
//! - [`records`]: what is kept, in the API's shapes, and OpenAI's limits;
//! - [`sqlite`]: the schema and its queries in SQLite (a file, or this process's memory);
//! - [`postgres`]: the same in PostgreSQL, one database for every gateway replica;
//! - [`store`]: [`HistoryStore`], what the gateway calls: each operation bounded by a
//!   timeout, so a slow or dead database is an error and never a hang;
//! - [`local_postgres`]: a throwaway PostgreSQL server for tests (this crate's and others').

pub mod args;
mod backend;
pub mod local_postgres;
pub mod postgres;
pub mod records;
pub mod sqlite;
pub mod store;

pub use args::HistoryArgs;
pub use records::{Conversation, Item, ItemPage, ListQuery, Metadata, Order, StoredResponse};
pub use store::{HistoryBackend, HistoryOptions, HistoryStore};

/// What can go wrong with the history.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The database could not be opened.
    #[error("cannot open the history store at {url}: {reason}")]
    Open {
        /// Where it was looked for.
        url: String,
        /// Why not.
        reason: String,
    },
    /// The database's schema is newer than this build knows.
    #[error(
        "the history store's schema is version {found}, newer than this pdserve knows \
         ({known}): run a newer pdserve, or point --history-url at another database"
    )]
    NewerSchema {
        /// The database's version.
        found: i64,
        /// This build's.
        known: i64,
    },
    /// The database failed or did not answer in time.
    #[error("the history store is unavailable: {0}")]
    Unavailable(String),
    /// An item id already in the conversation.
    #[error("an item with id '{0}' is already in this conversation")]
    DuplicateItem(String),
    /// A list's `after` names no item of the conversation.
    #[error("'after' names no item of this conversation: '{0}'")]
    UnknownCursor(String),
    /// The conversation a turn belongs to was deleted before the turn was stored.
    #[error("conversation '{0}' was deleted")]
    ConversationGone(String),
    /// A stored value is not the JSON it should be.
    #[error("the history store holds malformed JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl From<rusqlite::Error> for HistoryError {
    fn from(e: rusqlite::Error) -> Self {
        HistoryError::Unavailable(e.to_string())
    }
}
