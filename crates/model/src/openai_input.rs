//! OpenAI request shapes as the model's prompt input: chat messages as template turns,
//! and a `/tokenize` request as token ids. The engine and the gateway both answer
//! `/tokenize` and render chats, and must agree token for token; this is their one copy.

// `ApiError` is what both callers answer with; boxing it would only move the cost there.
#![allow(clippy::result_large_err)]

use pdserve_protocol::tokenize::TokenizeRequest;
use pdserve_protocol::{ApiError, ChatMessage, MessageContent};
use serde_json::Value;

use crate::{tokenize, ChatTemplate, ChatTurn, PromptInput, Tokenizer};

/// The messages as the template sees them. Only text content is accepted: a media part
/// would render differently on a multimodal worker, so the caller must not guess.
pub fn chat_turns(messages: &[ChatMessage]) -> Result<Vec<ChatTurn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").with_param("messages"));
    }
    messages
        .iter()
        .map(|m| {
            if let Some(MessageContent::Parts(parts)) = &m.content {
                if let Some(p) = parts
                    .iter()
                    .find(|p| p.get("type").and_then(Value::as_str) != Some("text"))
                {
                    return Err(ApiError::bad_request(format!(
                        "this model accepts only text content parts, got {}",
                        p.get("type").unwrap_or(&Value::Null)
                    ))
                    .with_param("messages"));
                }
            }
            Ok(ChatTurn {
                role: m.role.clone(),
                content: m
                    .content
                    .as_ref()
                    .map(MessageContent::text)
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// The token ids of a `/tokenize` request's prompt, and their spellings when it asks for
/// them (`return_token_strs`), as vLLM's `/tokenize` answers.
pub fn tokenize_request(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    request: &TokenizeRequest,
) -> Result<(Vec<u32>, Option<Vec<String>>), ApiError> {
    let turns;
    let (input, param) = match request {
        TokenizeRequest::Completion(r) => (
            PromptInput::Text {
                text: &r.prompt,
                add_special_tokens: r.add_special_tokens,
            },
            "prompt",
        ),
        TokenizeRequest::Chat(r) => {
            turns = chat_turns(&r.messages)?;
            (
                PromptInput::Chat {
                    turns: &turns,
                    add_generation_prompt: r.add_generation_prompt,
                    continue_final_message: r.continue_final_message,
                    add_special_tokens: r.add_special_tokens,
                },
                "messages",
            )
        }
    };
    let tokens = tokenize(tokenizer, template, input)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize: {e}")).with_param(param))?;
    let strs = request.return_token_strs().then(|| {
        tokens
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok((tokens, strs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn messages(v: Value) -> Vec<ChatMessage> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn text_parts_are_joined_and_media_parts_refused() {
        let turns = chat_turns(&messages(json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ])))
        .unwrap();
        assert_eq!(turns[1].content, "ab");
        assert_eq!(turns[0].role, "system");
        let err = chat_turns(&messages(json!([
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ])))
        .unwrap_err();
        assert!(err.to_string().contains("only text content parts"), "{err}");
        assert!(chat_turns(&[]).is_err());
    }
}
