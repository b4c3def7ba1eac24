//! Control messages, carried as JSON in frame payloads.

use serde::{Deserialize, Serialize};

/// Client → server: "send me the blocks you pinned for this request".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The engine the client expects to be talking to (`remote_engine_id`).
    pub engine_id: String,
    /// The request whose blocks were pinned (`remote_request_id`).
    pub request_id: String,
    /// Block ids as the server advertised them (`remote_block_ids`), in order.
    pub block_ids: Vec<u64>,
    /// The token ids the client wants KV for; the server reports how many leading
    /// tokens match what it computed, so a mismatch is detected rather than decoded.
    pub token_ids: Vec<u32>,
    /// The block layout the client can accept (see [`crate::BlockSource::layout`]).
    pub layout: String,
}

/// [`ReadRequest`] as it travels: the request's fields plus the transfer secret, so
/// the secret never sits in a struct that gets logged.
#[derive(Serialize, Deserialize)]
pub(crate) struct WireReadRequest<'a> {
    #[serde(flatten)]
    pub request: std::borrow::Cow<'a, ReadRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// Server → client: the read is accepted; `num_blocks` block frames follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadAccepted {
    /// Leading tokens of the request's `token_ids` that the blocks hold.
    pub matched_tokens: usize,
    /// Block frames that follow.
    pub num_blocks: usize,
    /// Bytes in each block.
    pub block_bytes: usize,
}

/// Why a server refused a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request was not a valid [`ReadRequest`].
    BadRequest,
    /// The client addressed another engine.
    WrongEngine,
    /// Nothing is pinned under this request id (never was, already read, or expired).
    UnknownRequest,
    /// The block ids do not match the ones pinned for the request.
    BlockMismatch,
    /// The client's block layout differs (another model or precision).
    LayoutMismatch,
    /// The server failed while reading its blocks.
    Internal,
    /// The read request carried no transfer secret, or another one than the server's.
    Unauthorized,
    /// The client's address is not in the server's `--kv-peers` allow-list.
    PeerNotAllowed,
    /// The blocks were kept as evictable cache (a decode worker's conversation
    /// hand-back) and the pool has reclaimed them: recompute instead.
    Gone,
}

/// Payload of an error frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorMessage {
    pub code: ErrorCode,
    pub message: String,
}
