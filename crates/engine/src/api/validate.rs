//! Checking OpenAI request fields and turning them into a [`GenerationRequest`]; every
//! problem becomes an OpenAI-shaped error naming the offending field.

use pdserve_protocol::{
    ApiError, ChatMessage, GenerationParams, MessageContent, StreamOptions, TransportParams,
};

use crate::request::GenerationRequest;

/// Most alternatives `top_logprobs` / completions `logprobs` may ask for (as vLLM).
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices (`n`) per request: OpenAI's own limit (vLLM sets none). Each choice is a
/// sequence of its own in the scheduler.
pub const MAX_CHOICES: i64 = 128;

pub use crate::serving::ModelLimits;

/// Output options that the HTTP side applies (the scheduler never sees them).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutputOptions {
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// Send a final chunk with usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Stop strings, cut from the output.
    pub stop: Vec<String>,
    /// List each choice's generated token ids (vLLM's `return_token_ids`; answered on
    /// non-streamed requests).
    pub return_token_ids: bool,
}

/// 404 unless `model` is absent or names the served model.
pub fn check_model(model: Option<&str>, limits: &ModelLimits) -> Result<(), ApiError> {
    match model {
        Some(m) if m != limits.served_model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// 400 for the first content part that is not text: the embedded model is text-only, so
/// an image, audio or video item (or its embeddings) is refused by name rather than
/// dropped from the prompt.
pub fn check_text_only(messages: &[ChatMessage]) -> Result<(), ApiError> {
    for (m, message) in messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else {
            continue;
        };
        for (p, part) in parts.iter().enumerate() {
            let kind = part.get("type").and_then(|t| t.as_str());
            if kind == Some("text") {
                continue;
            }
            let what = match kind {
                Some(kind) => format!("an item of type `{kind}`"),
                None => "a part without a `type`".to_string(),
            };
            return Err(invalid(
                "messages",
                format!(
                    "this model takes text only: messages[{m}].content[{p}] is {what}. \
                     Send images, audio and video to a model that accepts them."
                ),
            ));
        }
    }
    Ok(())
}

/// The stream flags, checked as vLLM does.
pub fn output_options(
    transport: &TransportParams,
    generation: &GenerationParams,
) -> Result<OutputOptions, ApiError> {
    let stream = transport.stream.unwrap_or(false);
    if transport.stream_options.is_some() && !stream {
        return Err(invalid(
            "stream_options",
            "stream_options can only be set when stream is true".into(),
        ));
    }
    let stop = generation
        .stop
        .as_ref()
        .map(|s| s.to_vec())
        .unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                stop.len()
            ),
        ));
    }
    let include_usage = transport
        .stream_options
        .as_ref()
        .and_then(|o: &StreamOptions| o.include_usage)
        .unwrap_or(false);
    Ok(OutputOptions {
        stream,
        include_usage,
        stop,
        return_token_ids: false,
    })
}

/// Checks `top_logprobs`-style counts.
pub fn top_logprobs(param: &str, n: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&n) {
        return Err(invalid(
            param,
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        ));
    }
    Ok(n as usize)
}

/// How many choices `n` asks for: 1 when absent, at most [`MAX_CHOICES`].
pub fn choice_count(n: Option<i64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n if (1..=MAX_CHOICES).contains(&n) => Ok(n as usize),
        n => Err(invalid(
            "n",
            format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
        )),
    }
}

/// vLLM's `priority` field of a request body (`extra`): an integer, 0 when absent.
pub fn request_priority(
    extra: &serde_json::Map<String, serde_json::Value>,
) -> Result<i64, ApiError> {
    match extra.get("priority") {
        None | Some(serde_json::Value::Null) => Ok(0),
        Some(value) => value.as_i64().ok_or_else(|| {
            invalid(
                "priority",
                format!("priority must be an integer, got {value}"),
            )
        }),
    }
}

/// An optional boolean request field the typed request leaves in `extra`
/// (`return_token_ids`, `first_token_from_prefill`): 400 for any other type.
pub fn boolean_field(
    extra: &serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Result<Option<bool>, ApiError> {
    match extra.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(value) => Err(invalid(
            name,
            format!("{name} must be a boolean, got {value}"),
        )),
    }
}

/// vLLM's `return_token_ids`, answered on non-streamed requests (a stream asking for it
/// is refused rather than answered without the ids).
pub fn return_token_ids(
    extra: &serde_json::Map<String, serde_json::Value>,
    stream: bool,
) -> Result<bool, ApiError> {
    let asked = boolean_field(extra, "return_token_ids")?.unwrap_or(false);
    if asked && stream {
        return Err(invalid(
            "return_token_ids",
            "return_token_ids is answered on non-streamed requests only".into(),
        ));
    }
    Ok(asked)
}

/// The scheduler request for `prompt` with the sampling fields of `params` (all but
/// `n`: each choice is a request of its own, see [`choice_count`]).
/// `max_tokens` is the (already chosen) `max_tokens`/`max_completion_tokens` value.
pub fn generation_request(
    prompt: Vec<u32>,
    params: &GenerationParams,
    max_tokens: Option<i64>,
    logprobs: Option<usize>,
    limits: &ModelLimits,
    prompt_param: &str,
) -> Result<GenerationRequest, ApiError> {
    let sampling = super::sampling_fields::sampling_params(params, limits)?;
    if prompt.is_empty() {
        return Err(invalid(prompt_param, "the prompt is empty".into()));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return Err(invalid(
            prompt_param,
            format!(
                "token id {bad} is out of range (vocabulary size {})",
                limits.vocab_size
            ),
        ));
    }
    let max_len = limits.max_model_len;
    if prompt.len() >= max_len {
        return Err(invalid(
            prompt_param,
            format!(
                "This model's maximum context length is {max_len} tokens. However, your \
                 request has {} input tokens. Please reduce the length of the input.",
                prompt.len()
            ),
        ));
    }
    let room = max_len - prompt.len();
    let max_new_tokens = match max_tokens {
        None => room,
        Some(m) if m <= 0 => {
            return Err(invalid(
                "max_tokens",
                format!("max_tokens must be at least 1, got {m}"),
            ))
        }
        Some(m) if m as u64 > room as u64 => {
            return Err(invalid(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you \
                     requested {} tokens ({} in the input, {m} in the completion). Please \
                     reduce the length of the input or completion.",
                    prompt.len() as i64 + m,
                    prompt.len()
                ),
            ))
        }
        Some(m) => m as usize,
    };
    let min_new_tokens = match params.min_tokens.unwrap_or(0) {
        m if m < 0 => {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens must be non-negative, got {m}"),
            ))
        }
        m if m as u64 > max_new_tokens as u64 => {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens ({m}) must not exceed max_tokens ({max_new_tokens})"),
            ))
        }
        m => m as usize,
    };
    let stop_token_ids = if params.ignore_eos.unwrap_or(false) {
        Vec::new()
    } else {
        limits.eos_token_ids.clone()
    };
    Ok(GenerationRequest {
        prompt,
        sampling,
        max_new_tokens,
        stop_token_ids,
        min_new_tokens,
        logprobs,
        prompt_logprobs: None,
        pin_on_finish: false,
        copy_on_finish: false,
        kv_feed: None,
        kv_import: None,
        first_token: None,
        priority: 0,
        trace: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn limits() -> ModelLimits {
        ModelLimits {
            served_model_name: "m".into(),
            max_model_len: 100,
            eos_token_ids: vec![2],
            vocab_size: 1000,
        }
    }

    fn check(
        params: GenerationParams,
        max_tokens: Option<i64>,
        prompt_len: usize,
    ) -> Result<GenerationRequest, ApiError> {
        generation_request(
            vec![5; prompt_len],
            &params,
            max_tokens,
            None,
            &limits(),
            "prompt",
        )
    }

    fn param_of(e: ApiError) -> String {
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        e.body.error.param.unwrap_or_default()
    }

    #[test]
    fn defaults_fill_the_context_and_stop_at_eos() {
        let r = check(GenerationParams::default(), None, 10).unwrap();
        assert_eq!(r.max_new_tokens, 90);
        assert_eq!(r.stop_token_ids, vec![2]);
        assert_eq!(r.sampling.temperature, 1.0);
        let r = check(
            GenerationParams {
                ignore_eos: Some(true),
                ..Default::default()
            },
            Some(5),
            10,
        )
        .unwrap();
        assert!(r.stop_token_ids.is_empty());
        assert_eq!(r.max_new_tokens, 5);
    }

    #[test]
    fn each_bad_field_is_named() {
        let p = GenerationParams::default;
        assert_eq!(param_of(check(p(), Some(0), 10).unwrap_err()), "max_tokens");
        assert_eq!(
            param_of(check(p(), Some(-3), 10).unwrap_err()),
            "max_tokens"
        );
        assert_eq!(
            param_of(check(p(), Some(91), 10).unwrap_err()),
            "max_tokens"
        );
        assert_eq!(param_of(check(p(), None, 100).unwrap_err()), "prompt");
        assert_eq!(param_of(check(p(), None, 0).unwrap_err()), "prompt");
        assert_eq!(choice_count(None).unwrap(), 1);
        assert_eq!(choice_count(Some(MAX_CHOICES)).unwrap(), 128);
        for n in [0, -1, MAX_CHOICES + 1] {
            assert_eq!(param_of(choice_count(Some(n)).unwrap_err()), "n");
        }
        assert_eq!(
            param_of(
                check(
                    GenerationParams {
                        temperature: Some(-1.0),
                        ..p()
                    },
                    None,
                    3
                )
                .unwrap_err()
            ),
            "temperature"
        );
        assert_eq!(
            param_of(
                check(
                    GenerationParams {
                        top_p: Some(0.0),
                        ..p()
                    },
                    None,
                    3
                )
                .unwrap_err()
            ),
            "top_p"
        );
        assert_eq!(
            param_of(
                check(
                    GenerationParams {
                        top_k: Some(-2),
                        ..p()
                    },
                    None,
                    3
                )
                .unwrap_err()
            ),
            "top_k"
        );
        assert_eq!(
            param_of(
                check(
                    GenerationParams {
                        min_tokens: Some(9),
                        ..p()
                    },
                    Some(4),
                    3
                )
                .unwrap_err()
            ),
            "min_tokens"
        );
        let bad_id = generation_request(vec![1000], &p(), None, None, &limits(), "prompt");
        assert_eq!(param_of(bad_id.unwrap_err()), "prompt");
        assert_eq!(
            param_of(top_logprobs("top_logprobs", 21).unwrap_err()),
            "top_logprobs"
        );
    }

    #[test]
    fn media_items_are_refused_by_name() {
        let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "system", "content": "plain"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]))
        .unwrap();
        assert!(check_text_only(&messages).is_ok());
        for (part, what) in [
            (
                serde_json::json!({"type": "image_url", "image_url": {"url": "http://x"}}),
                "an item of type `image_url`",
            ),
            (
                serde_json::json!({"type": "input_audio", "input_audio": {}}),
                "an item of type `input_audio`",
            ),
            (
                serde_json::json!({"type": "image_embeds", "image_embeds": {}}),
                "an item of type `image_embeds`",
            ),
            (
                serde_json::json!({"text": "no type"}),
                "a part without a `type`",
            ),
        ] {
            let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
                {"role": "user", "content": [{"type": "text", "text": "hi"}, part]},
            ]))
            .unwrap();
            let e = check_text_only(&messages).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.body.error.param.as_deref(), Some("messages"));
            let message = e.body.error.message;
            assert!(
                message.starts_with("this model takes text only"),
                "{message}"
            );
            assert!(
                message.contains("messages[0].content[1]") && message.contains(what),
                "{message}"
            );
        }
    }

    #[test]
    fn unknown_model_is_404_and_stream_options_need_stream() {
        assert_eq!(
            check_model(Some("gpt-4"), &limits()).unwrap_err().status,
            StatusCode::NOT_FOUND
        );
        assert!(check_model(Some("m"), &limits()).is_ok());
        assert!(check_model(None, &limits()).is_ok());
        let transport = TransportParams {
            stream_options: Some(StreamOptions::default()),
            ..Default::default()
        };
        let e = output_options(&transport, &GenerationParams::default()).unwrap_err();
        assert_eq!(param_of(e), "stream_options");
    }
}
