//! Shapes and hyperparameters of a loaded model.

/// Shape facts about a loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` (e.g. `llama`).
    pub architecture: String,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Rows of the embedding (and logits per token).
    pub vocab_size: usize,
    /// Longest sequence the model was trained for.
    pub context_length: usize,
}

impl ModelConfig {
    /// K (or V) values of one token in one layer: `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// Everything the forward pass needs beyond [`ModelConfig`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Hyperparams {
    pub config: ModelConfig,
    pub ffn_size: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
}
