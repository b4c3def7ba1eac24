//! `--tokenizer`: the gateway tokenizes prompts as the workers do — pdserve-model's
//! `Tokenizer` and `ChatTemplate`, the code the engine itself runs: a chat's messages are
//! rendered with the model's template (generation prompt added) and encoded without
//! special tokens; a completion's text is encoded with them. Routing then sees the
//! prompt's token ids: the prefix tree and the KV-event indexes match tokens, and
//! `--disagg-threshold` and the context-length check count exactly. Token-id prompts need
//! no tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdserve_model::{ChatTemplate, Tokenizer};
use pdserve_protocol::Prompt;

use crate::error::GatewayError;
use crate::ingress::request::ClientRequest;

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
    /// `chat_template.jinja`; the folder or its `tokenizer.json`); up to `cache_bytes` of
    /// token ids of text between special tokens are remembered.
    pub fn load(path: &Path, cache_bytes: usize) -> Result<Self, GatewayError> {
        let bad = |e: pdserve_model::ModelError| {
            GatewayError::Config(format!("--tokenizer {}: {e}", path.display()))
        };
        let (mut tokenizer, template) = if pdserve_model::is_hf_tokenizer(path) {
            let tokenizer = Tokenizer::from_hf_folder(path).map_err(bad)?;
            let template = ChatTemplate::from_hf_folder(path, &tokenizer).map_err(bad)?;
            (tokenizer, template)
        } else {
            let tokenizer = Tokenizer::load(path).map_err(bad)?;
            let template = ChatTemplate::load(path, &tokenizer).map_err(bad)?;
            (tokenizer, template)
        };
        let cached = tokenizer.cache_pieces(cache_bytes);
        tracing::debug!(cached, cache_bytes, "gateway tokenizer");
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
                let turns = pdserve_model::chat_turns(&chat.messages).ok()?;
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

/// Tokens a chat template may add around the messages (its markers and a default system
/// prompt), for the bound in [`may_overflow`].
const TEMPLATE_TOKENS: u64 = 1024;
/// Tokens a template may add per message.
const MESSAGE_TOKENS: u64 = 64;

/// Whether the context-length check could need `request`'s exact count: its prompt,
/// bounded by its bytes (a byte-level token holds at least one byte) plus what a template
/// adds, and its `max_tokens` may exceed `max_model_len`. Otherwise counting is skipped
/// when nothing else reads the tokens: the check passes on the bound alone.
pub fn may_overflow(request: &ClientRequest, max_model_len: Option<u64>) -> bool {
    let Some(limit) = max_model_len else {
        // No length known yet: the check does not run.
        return false;
    };
    let (messages, asked) = match request {
        ClientRequest::Chat(chat) => (
            chat.messages.len() as u64,
            chat.generation
                .max_completion_tokens
                .or(chat.generation.max_tokens),
        ),
        ClientRequest::Completion(c) => (0, c.generation.max_tokens),
    };
    let bound = prompt_bytes(request) as u64 + TEMPLATE_TOKENS + messages * MESSAGE_TOKENS;
    let asked = asked.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
    bound.saturating_add(asked) >= limit
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

/// The ids of a token-id prompt (the first of a batch), as the client sent them: what the
/// workers compute, so routing, the latency predictor and the planner read them as they
/// read a tokenized prompt's, with no tokenizer. `None` for text and empty prompts.
pub fn client_token_ids(request: &ClientRequest) -> Option<&[u32]> {
    let ClientRequest::Completion(c) = request else {
        return None;
    };
    let ids = match &c.prompt {
        Prompt::Tokens(ids) => ids.as_slice(),
        Prompt::TokenBatches(batches) => batches.first()?.as_slice(),
        Prompt::Text(_) | Prompt::Texts(_) => return None,
    };
    (!ids.is_empty()).then_some(ids)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;

    fn chat(content: &str, max_tokens: Option<u64>) -> ClientRequest {
        let mut body = serde_json::json!({"messages": [{"role": "user", "content": content}]});
        if let Some(n) = max_tokens {
            body["max_tokens"] = n.into();
        }
        ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
            .unwrap()
            .0
    }

    fn completion(prompt: serde_json::Value) -> ClientRequest {
        let body = serde_json::json!({"prompt": prompt});
        ClientRequest::parse(Endpoint::Completions, body.to_string().as_bytes())
            .unwrap()
            .0
    }

    #[test]
    fn a_token_id_prompt_is_its_own_ids() {
        let ids = completion(serde_json::json!([5, 6, 7]));
        assert_eq!(client_token_ids(&ids), Some(&[5, 6, 7][..]));
        let batch = completion(serde_json::json!([[1, 2], [3]]));
        assert_eq!(
            client_token_ids(&batch),
            Some(&[1, 2][..]),
            "the first of a batch"
        );
        assert_eq!(
            client_token_ids(&completion(serde_json::json!("text"))),
            None
        );
        assert_eq!(client_token_ids(&chat("Hello", None)), None);
    }

    #[test]
    fn only_a_request_that_may_not_fit_is_counted_for_the_length_check() {
        // Far inside the context: the bound alone passes the check.
        assert!(!may_overflow(&chat("Hello", Some(16)), Some(8192)));
        // No context length known yet: the check does not run.
        assert!(!may_overflow(&chat("Hello", Some(100_000)), None));
        // A small context, a long answer or a long prompt: count.
        assert!(may_overflow(&chat("Hello", Some(16)), Some(64)));
        assert!(may_overflow(&chat("Hello", Some(8000)), Some(8192)));
        assert!(may_overflow(&chat(&"word ".repeat(2000), None), Some(8192)));
    }
}
