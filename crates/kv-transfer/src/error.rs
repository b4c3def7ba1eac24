//! Why a transfer failed.

use crate::message::ErrorCode;

/// A failed transfer, on either side.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("could not connect to KV peer {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("KV transfer timed out while {0}")]
    Timeout(&'static str),
    #[error("KV transfer I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV peer spoke an invalid protocol: {0}")]
    Protocol(String),
    #[error("KV peer refused the read ({code:?}): {message}")]
    Remote { code: ErrorCode, message: String },
}
