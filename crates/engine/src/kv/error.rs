//! Why a KV handoff failed, in the engine's terms; `api/` decides what clients see.

use pdserve_kv_transfer::TransferError;

/// A KV handoff that could not be done.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// `do_remote_decode` and `do_remote_prefill` were both set.
    #[error("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")]
    ConflictingDirections,
    /// `remote_host` is not in this worker's `--kv-peers`: refused without connecting,
    /// so the answer is the same whatever listens there.
    #[error(
        "kv_transfer_params.remote_host {host:?} is not an allowed KV peer of this worker \
         (see --kv-peers)"
    )]
    PeerNotAllowed {
        /// The refused `remote_host`.
        host: String,
    },
    /// A field needed to read KV from a peer is absent.
    #[error("kv_transfer_params.{0} is required to read KV from a peer")]
    MissingField(&'static str),
    /// The peer did not answer within the pull's timeouts.
    #[error("reading KV blocks from {addr} failed: {source}")]
    PullTimedOut {
        /// The peer's KV service.
        addr: String,
        /// What timed out.
        #[source]
        source: TransferError,
    },
    /// The peer answered but refused the read (unknown or expired request, other blocks,
    /// another engine or KV layout).
    #[error("reading KV blocks from {addr} failed: {source}")]
    PeerRefused {
        /// The peer's KV service.
        addr: String,
        /// The peer's refusal.
        #[source]
        source: TransferError,
    },
    /// Connecting to the peer or reading from it failed.
    #[error("reading KV blocks from {addr} failed: {source}")]
    PullFailed {
        /// The peer's KV service.
        addr: String,
        /// The connection or protocol failure.
        #[source]
        source: TransferError,
    },
    /// `publish_request_id` is not a string, or names an id in use here.
    #[error("kv_transfer_params.publish_request_id: {0}")]
    BadPublishId(String),
    /// The peer's KV holds another prompt than this request's.
    #[error(
        "the prefill worker's KV covers only {covered} of this prompt's {prompt_tokens} \
         tokens: it was computed for another prompt (different chat template, tokenizer or \
         model?)"
    )]
    PromptNotCovered {
        /// Leading prompt tokens the peer's KV matches.
        covered: usize,
        /// Tokens in this request's prompt.
        prompt_tokens: usize,
    },
}

impl HandoffError {
    /// Classifies a failed pull from `addr`.
    pub fn pull(addr: &str, source: TransferError) -> Self {
        let addr = addr.to_string();
        match source {
            TransferError::Timeout(_) => Self::PullTimedOut { addr, source },
            TransferError::Remote { .. } => Self::PeerRefused { addr, source },
            _ => Self::PullFailed { addr, source },
        }
    }
}
