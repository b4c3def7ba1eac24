//! Blocks an accepted read still waits for: a prefill that is computing them while its
//! reader is already connected. The server announces them in `ReadAccepted` and sends
//! each one as soon as its source yields it; the wire format is unchanged, only the
//! frames' timing is.

use std::future::Future;
use std::pin::Pin;

use crate::message::ErrorCode;

/// The next pending block, or why it will never come.
pub type NextBlock<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<u8>, (ErrorCode, String)>> + Send + 'a>>;

/// A source of blocks that do not exist yet, yielded in index order.
///
/// The server waits for each one without its per-frame timeout (a chunk of a long
/// prompt may take longer than a frame may): the source must bound every wait itself,
/// below the readers' frame timeout, and fail instead of hanging.
pub trait PendingBlocks: Send {
    /// The next block once it exists (exactly `block_bytes` long), or an error that
    /// ends the read with an `Error` frame.
    fn next_block(&mut self) -> NextBlock<'_>;
}

/// The part of an [`crate::Export`] still being computed.
pub struct Pending {
    /// How many blocks follow the export's ready ones.
    pub count: usize,
    /// Yields them, in order.
    pub blocks: Box<dyn PendingBlocks>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}
