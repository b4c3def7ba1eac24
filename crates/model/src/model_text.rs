//! What serving needs of a model besides its forward pass: its shapes, tokenizer and chat
//! template, read from a GGUF's metadata without loading the weights (a simulated engine
//! serves the same text interface with no weights at all).

use std::path::Path;

use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// A model's shapes, tokenizer and chat template.
pub struct ModelText {
    config: ModelConfig,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
}

impl ModelText {
    /// Reads a llama-family GGUF's metadata (its tensors are not read).
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(&gguf)
    }

    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let config = gguf.hyperparams()?.config;
        let tokenizer = Tokenizer::from_gguf(gguf)?;
        let chat_template = ChatTemplate::from_gguf(gguf, &tokenizer)?;
        Ok(Self {
            config,
            tokenizer,
            chat_template,
        })
    }

    /// Shapes of the model.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Its chat template.
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.chat_template
    }
}
