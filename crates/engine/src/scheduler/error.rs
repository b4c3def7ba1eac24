//! Why the scheduler refused a request or a KV block operation.

use pdserve_model::BlockId;

use crate::block_manager::BlockError;

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The bounded waiting queue is full.
    #[error("the server is at capacity: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    /// The scheduler thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// A non-zero `priority` without `--scheduling-policy priority` (as vLLM refuses it).
    #[error(
        "priority scheduling is not enabled (start the worker with --scheduling-policy priority)"
    )]
    PriorityNotEnabled,
}

/// Why a KV block operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A block to read is not pinned (never exported, or already released).
    #[error("block {0} is not pinned")]
    NotPinned(BlockId),
    /// The block manager refused the operation.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The scheduler thread is gone.
    #[error("the engine has stopped")]
    Stopped,
}
