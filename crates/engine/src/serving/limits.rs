//! What request validation needs to know about the served model.

/// What validation needs to know about the served model.
#[derive(Debug, Clone)]
pub struct ModelLimits {
    /// Name clients must use in `model` (or omit).
    pub served_model_name: String,
    /// Most tokens (prompt plus completion) of one sequence.
    pub max_model_len: usize,
    /// Tokens that end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Token ids must be below this.
    pub vocab_size: usize,
}
