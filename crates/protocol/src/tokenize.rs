//! vLLM's `POST /tokenize` and `POST /detokenize` bodies: a text prompt or chat messages
//! in, token ids out; token ids in, text out.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ChatMessage;

fn yes() -> bool {
    true
}

/// `POST /tokenize` with a text prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeCompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: String,
    /// Add the model's special tokens (BOS) as a completion would (default true).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Also return each token's vocabulary spelling.
    #[serde(default)]
    pub return_token_strs: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /tokenize` with chat messages, rendered with the model's chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeChatRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// End with the assistant turn's opening, as a chat completion does (default true).
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open, for the model to continue it.
    #[serde(default)]
    pub continue_final_message: bool,
    /// Add special tokens on top of the template's own (default false).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// Also return each token's vocabulary spelling.
    #[serde(default)]
    pub return_token_strs: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A `/tokenize` body: chat messages when it has `messages`, else a text prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TokenizeRequest {
    Chat(TokenizeChatRequest),
    Completion(TokenizeCompletionRequest),
}

impl TokenizeRequest {
    /// Reads a body; the error names what is wrong with the shape it has.
    pub fn from_value(body: Value) -> Result<Self, serde_json::Error> {
        if body.get("messages").is_some() {
            serde_json::from_value(body).map(Self::Chat)
        } else {
            serde_json::from_value(body).map(Self::Completion)
        }
    }

    /// The model the client named.
    pub fn model(&self) -> Option<&str> {
        match self {
            Self::Chat(r) => r.model.as_deref(),
            Self::Completion(r) => r.model.as_deref(),
        }
    }

    /// Whether token spellings were asked for.
    pub fn return_token_strs(&self) -> bool {
        match self {
            Self::Chat(r) => r.return_token_strs,
            Self::Completion(r) => r.return_token_strs,
        }
    }
}

/// The answer to `/tokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    /// How many tokens.
    pub count: usize,
    /// The served model's context length.
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    /// Each token's vocabulary spelling, when asked for.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The answer to `/detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    /// The tokens' text.
    pub prompt: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_body_with_messages_is_a_chat_and_defaults_are_vllms() {
        let chat =
            TokenizeRequest::from_value(json!({"messages": [{"role": "user", "content": "hi"}]}));
        let TokenizeRequest::Chat(chat) = chat.unwrap() else {
            panic!("a chat")
        };
        assert!(
            chat.add_generation_prompt && !chat.add_special_tokens && !chat.continue_final_message
        );
        let text = TokenizeRequest::from_value(json!({"prompt": "hi", "model": "m"})).unwrap();
        let TokenizeRequest::Completion(text) = text else {
            panic!("a prompt")
        };
        assert!(text.add_special_tokens && !text.return_token_strs);
        assert_eq!(text.model.as_deref(), Some("m"));
        let wrong = TokenizeRequest::from_value(json!({"prompt": 5})).unwrap_err();
        assert!(wrong.to_string().contains("invalid type"), "{wrong}");
        assert!(TokenizeRequest::from_value(json!({}))
            .unwrap_err()
            .to_string()
            .contains("prompt"));
    }

    #[test]
    fn token_strs_are_null_unless_asked_for() {
        let response = TokenizeResponse {
            count: 1,
            max_model_len: 8,
            tokens: vec![3],
            token_strs: None,
        };
        assert_eq!(
            serde_json::to_value(&response).unwrap(),
            json!({"count": 1, "max_model_len": 8, "tokens": [3], "token_strs": null})
        );
    }
}
