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
    /// W3C `traceparent` of the reader's span, so the server's span of this read joins
    /// the request's trace (absent from older peers and untraced reads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// W3C `tracestate` going with `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
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
    /// Of the matched tokens, how many the request that published them did not compute
    /// itself (absent from older peers: none).
    #[serde(default)]
    pub reused: ReusedTokens,
}

/// Leading tokens of published KV that the publishing request did not compute, by where
/// their KV came from. A reader that imports the blocks passes these on in its usage
/// (`cached_tokens`): they were computed by no one for this request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReusedTokens {
    /// Found in the publisher's prefix cache.
    #[serde(default)]
    pub prefix_cache_tokens: usize,
    /// Computed by an earlier turn of the conversation and handed back to the publisher.
    #[serde(default)]
    pub earlier_turn_tokens: usize,
}

impl ReusedTokens {
    /// All reused tokens.
    pub fn total(&self) -> usize {
        self.prefix_cache_tokens + self.earlier_turn_tokens
    }

    /// The same counts cut to the first `tokens` tokens (prefix-cache hits lead).
    pub fn within(self, tokens: usize) -> Self {
        let prefix_cache_tokens = self.prefix_cache_tokens.min(tokens);
        Self {
            prefix_cache_tokens,
            earlier_turn_tokens: self.earlier_turn_tokens.min(tokens - prefix_cache_tokens),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_without_reused_counts_reads_as_none() {
        let old: ReadAccepted =
            serde_json::from_str(r#"{"matched_tokens":9,"num_blocks":1,"block_bytes":8}"#).unwrap();
        assert_eq!(old.reused, ReusedTokens::default());
    }

    #[test]
    fn reused_counts_are_cut_to_a_prefix() {
        let r = ReusedTokens {
            prefix_cache_tokens: 32,
            earlier_turn_tokens: 10,
        };
        assert_eq!(r.within(100), r);
        assert_eq!(r.within(40).total(), 40);
        assert_eq!(r.within(40).earlier_turn_tokens, 8);
        assert_eq!(r.within(16).total(), 16);
        assert_eq!(r.within(16).earlier_turn_tokens, 0);
    }
}
