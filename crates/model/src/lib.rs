//! Llama-family GGUF models on the CPU: tokenizer and chat template from the GGUF
//! metadata, and a forward pass over an explicit, paged KV store whose blocks can be
//! read out and written in as bytes.

mod attention;
mod chat_template;
mod config;
mod error;
mod fetch;
mod gguf;
mod kv_store;
mod linear;
mod model;
mod quant_matmul;
mod reference_attention;
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
pub use threads::set_threads;
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
