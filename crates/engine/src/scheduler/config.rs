//! The scheduler's limits.

use crate::scheduling::SchedulingPolicy;

/// Limits of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most requests waiting for admission; more are refused (HTTP 429).
    pub max_waiting: usize,
    /// Most tokens run in one step (prompt chunks plus decode tokens).
    pub max_num_batched_tokens: usize,
    /// Most tokens (prompt plus generated) of one sequence.
    pub max_model_len: usize,
    /// Which sequences get each step's token budget first.
    pub policy: SchedulingPolicy,
}
