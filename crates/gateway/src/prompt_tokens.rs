//! `--tokenizer`: the gateway tokenizes prompts as the workers do — pdserve-model's
//! `Tokenizer` and `ChatTemplate`, the code the engine itself runs: a chat's messages are
//! rendered with the model's template (generation prompt added) and encoded without
//! special tokens; a completion's text is encoded with them. Routing then sees the
//! prompt's token ids: the prefix tree and the KV-event indexes match tokens, and
//! `--disagg-threshold` and the context-length check count exactly. Token-id prompts need
//! no tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdserve_model::{ChatTemplate, ChatTurn, Tokenizer};
use pdserve_protocol::{MessageContent, Prompt};

use crate::request::ClientRequest;
use crate::GatewayError;

/// Prompts longer than this many bytes are tokenized on the blocking pool, not on the
/// request's async task.
const INLINE_BYTES: usize = 2048;

/// The served model's tokenizer and chat template.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    path: PathBuf,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl PromptTokenizer {
    /// Reads the tokenizer and chat template of a GGUF file (its metadata, no weights),
    /// or of a Hugging Face model folder (`tokenizer.json`, `tokenizer_config.json`,
    /// `chat_template.jinja`; the folder or its `tokenizer.json`).
    pub fn load(path: &Path) -> Result<Self, GatewayError> {
        let bad = |e: pdserve_model::ModelError| {
            GatewayError::Config(format!("--tokenizer {}: {e}", path.display()))
        };
        let (tokenizer, template) = if pdserve_model::is_hf_tokenizer(path) {
            let tokenizer = Tokenizer::from_hf_folder(path).map_err(bad)?;
            let template = ChatTemplate::from_hf_folder(path, &tokenizer).map_err(bad)?;
            (tokenizer, template)
        } else {
            let tokenizer = Tokenizer::load(path).map_err(bad)?;
            let template = ChatTemplate::load(path, &tokenizer).map_err(bad)?;
            (tokenizer, template)
        };
        Ok(Self {
            tokenizer,
            template,
            path: path.to_path_buf(),
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The token ids the workers will compute for `request`'s (first) prompt; `None` for
    /// token-id prompts (they are their own ids) and for what the workers will refuse
    /// anyway (their error is the one the client gets).
    pub fn tokens(&self, request: &ClientRequest) -> Option<Vec<u32>> {
        match request {
            ClientRequest::Chat(chat) => {
                let turns: Vec<ChatTurn> = chat
                    .messages
                    .iter()
                    .map(|m| ChatTurn {
                        role: m.role.clone(),
                        content: m
                            .content
                            .as_ref()
                            .map(MessageContent::text)
                            .unwrap_or_default(),
                    })
                    .collect();
                let text = self.template.render(&turns, true).ok()?;
                self.tokenizer.encode(&text, false).ok()
            }
            ClientRequest::Completion(c) => match &c.prompt {
                Prompt::Text(text) => self.tokenizer.encode(text, true).ok(),
                Prompt::Texts(texts) => self.tokenizer.encode(texts.first()?, true).ok(),
                Prompt::Tokens(_) | Prompt::TokenBatches(_) => None,
            },
        }
    }
}

/// A rough size of the request's prompt text, to decide where to tokenize it.
fn prompt_bytes(request: &ClientRequest) -> usize {
    match request {
        ClientRequest::Chat(chat) => chat
            .messages
            .iter()
            .map(|m| m.content.as_ref().map_or(0, |c| c.text().len()))
            .sum(),
        ClientRequest::Completion(c) => match &c.prompt {
            Prompt::Text(text) => text.len(),
            Prompt::Texts(texts) => texts.first().map_or(0, String::len),
            Prompt::Tokens(_) | Prompt::TokenBatches(_) => 0,
        },
    }
}

/// `request`'s prompt tokens with `tokenizer`, off the async runtime when the prompt is
/// long.
pub async fn tokenize(
    tokenizer: &Arc<PromptTokenizer>,
    request: &ClientRequest,
) -> Option<Arc<[u32]>> {
    if prompt_bytes(request) <= INLINE_BYTES {
        return tokenizer.tokens(request).map(Arc::from);
    }
    let (tokenizer, request) = (tokenizer.clone(), request.clone());
    tokio::task::spawn_blocking(move || tokenizer.tokens(&request))
        .await
        .ok()
        .flatten()
        .map(Arc::from)
}
