//! `--history-*` flags, shared by `pdserve gateway` and `pdserve up`.

use std::time::Duration;

use crate::store::{HistoryBackend, HistoryOptions};

/// Where stored responses and conversations are kept.
#[derive(Debug, Clone, clap::Args)]
pub struct HistoryArgs {
    /// Where stored responses (`previous_response_id` chains) and conversations
    /// (`/v1/conversations`) live. `memory`: in this process, lost on restart, not
    /// shared; `sqlite`: a file (--history-url), kept across restarts; `postgres`: a
    /// PostgreSQL database (--history-url), shared by every gateway replica; `none`:
    /// nothing is kept, and the Conversations API answers 503.
    #[arg(long, env = "PDSERVE_HISTORY_BACKEND", value_enum, default_value_t = HistoryBackend::Memory)]
    pub history_backend: HistoryBackend,

    /// The database: a file path for `sqlite` (`sqlite://PATH` also accepted; its folder
    /// is created), or `postgres://USER[:PASSWORD]@HOST:PORT/DATABASE` for `postgres` (no
    /// TLS yet; the gateway refuses to start when it cannot reach it).
    #[arg(long, env = "PDSERVE_HISTORY_URL", hide_env_values = true)]
    pub history_url: Option<String>,

    /// Responses and conversations older than this many seconds are deleted from the
    /// database (a conversation once its last item is that old). 0 keeps them until the
    /// size bounds push them out.
    #[arg(long, env = "PDSERVE_HISTORY_RETENTION_SECS", default_value_t = 30 * 24 * 3600)]
    pub history_retention_secs: u64,

    /// Most stored responses; past it the oldest are deleted. (`--max-stored-responses`,
    /// its name before the history store, is accepted too.)
    #[arg(
        long,
        alias = "max-stored-responses",
        env = "PDSERVE_HISTORY_MAX_RESPONSES",
        default_value_t = 100_000
    )]
    pub history_max_responses: usize,

    /// Most conversations; past it the oldest are deleted with their items.
    #[arg(
        long,
        env = "PDSERVE_HISTORY_MAX_CONVERSATIONS",
        default_value_t = 100_000
    )]
    pub history_max_conversations: usize,

    /// Longest a history call may take, in milliseconds: past it the request that needed
    /// the history gets 503 (the store is unavailable), never a hang.
    #[arg(long, env = "PDSERVE_HISTORY_TIMEOUT_MS", default_value_t = 2000)]
    pub history_timeout_ms: u64,
}

impl HistoryArgs {
    /// The options these flags give.
    pub fn to_options(&self) -> HistoryOptions {
        HistoryOptions {
            backend: self.history_backend,
            url: self.history_url.clone(),
            retention: Duration::from_secs(self.history_retention_secs),
            max_responses: self.history_max_responses.max(1),
            max_conversations: self.history_max_conversations.max(1),
            timeout: Duration::from_millis(self.history_timeout_ms.max(1)),
        }
    }
}
