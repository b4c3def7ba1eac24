//! Request fields the engine does not implement: answered with a 400 naming the field
//! instead of being silently ignored.

use pdserve_protocol::ApiError;
use serde_json::{Map, Value};

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// Request fields this worker does not implement, each with the values that mean "not
/// used" (accepted, as a client library may send them by default). Any other value is
/// refused rather than silently ignored. Fields not listed (`user`, `metadata`,
/// `conversation_id`, `chat_template_kwargs`, ...) change nothing about the output and
/// are accepted.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("tools", "tool calling"),
    ("tool_choice", "tool calling"),
    ("functions", "function calling"),
    ("function_call", "function calling"),
    (
        "response_format",
        "structured output (only {\"type\": \"text\"})",
    ),
    ("structured_outputs", "structured output"),
    ("guided_json", "guided decoding"),
    ("guided_regex", "guided decoding"),
    ("guided_choice", "guided decoding"),
    ("guided_grammar", "guided decoding"),
    ("guided_whitespace_pattern", "guided decoding"),
    ("best_of", "best_of above 1"),
    ("use_beam_search", "beam search"),
    ("length_penalty", "beam search"),
    ("prompt_logprobs", "prompt logprobs"),
    ("return_tokens_as_token_ids", "token-id logprobs"),
    ("suffix", "suffix (insertion)"),
    ("allowed_token_ids", "allowed_token_ids"),
    ("bad_words", "bad_words"),
    (
        "stop_token_ids",
        "stop_token_ids (EOS ends generation unless ignore_eos)",
    ),
    ("include_stop_str_in_output", "include_stop_str_in_output"),
    ("prediction", "predicted outputs"),
    ("audio", "audio output"),
    ("modalities", "output modalities other than text"),
];

/// Whether `value` of `field` asks for nothing beyond what the worker does anyway.
fn is_neutral(field: &str, value: &Value) -> bool {
    let empty = |v: &Value| match v {
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    };
    value.is_null()
        || match field {
            "tool_choice" | "function_call" => value == "none",
            "response_format" => value.get("type").and_then(Value::as_str) == Some("text"),
            "best_of" => value.as_f64() == Some(1.0),
            "length_penalty" => value.as_f64() == Some(1.0),
            "use_beam_search" | "return_tokens_as_token_ids" | "include_stop_str_in_output" => {
                value == false
            }
            "modalities" => value
                .as_array()
                .is_some_and(|m| m.iter().all(|v| v == "text")),
            _ => empty(value),
        }
}

/// 400 naming the first request field (of those the typed request leaves in `extra`)
/// that asks for something this worker does not implement.
pub fn check_unsupported(extra: &Map<String, Value>) -> Result<(), ApiError> {
    for &(field, what) in UNSUPPORTED {
        let Some(value) = extra.get(field) else {
            continue;
        };
        if !is_neutral(field, value) {
            return Err(invalid(
                field,
                format!(
                    "{field} is not supported by this worker ({what} is not implemented); \
                     remove the field or send it as null"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn param_of(e: ApiError) -> String {
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        e.body.error.param.unwrap_or_default()
    }

    #[test]
    fn unimplemented_fields_are_refused_by_name_unless_neutral() {
        let extra = |v: Value| v.as_object().unwrap().clone();
        for neutral in [
            serde_json::json!({"tools": [], "tool_choice": "none", "functions": null}),
            serde_json::json!({"response_format": {"type": "text"}, "best_of": 1}),
            serde_json::json!({"user": "u", "metadata": {"a": 1}, "modalities": ["text"]}),
            serde_json::json!({"conversation_id": "c", "use_beam_search": false}),
        ] {
            assert!(check_unsupported(&extra(neutral)).is_ok());
        }
        for (body, field) in [
            (
                serde_json::json!({"tools": [{"type": "function"}]}),
                "tools",
            ),
            (serde_json::json!({"tool_choice": "auto"}), "tool_choice"),
            (
                serde_json::json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (serde_json::json!({"best_of": 2}), "best_of"),
            (
                serde_json::json!({"guided_json": {"type": "object"}}),
                "guided_json",
            ),
            (
                serde_json::json!({"guided_choice": ["a", "b"]}),
                "guided_choice",
            ),
            (
                serde_json::json!({"functions": [{"name": "f"}]}),
                "functions",
            ),
            (serde_json::json!({"prompt_logprobs": 1}), "prompt_logprobs"),
            (serde_json::json!({"suffix": "end"}), "suffix"),
        ] {
            let e = check_unsupported(&extra(body)).unwrap_err();
            assert!(e.body.error.message.contains("not supported"), "{e}");
            assert_eq!(param_of(e), field);
        }
    }
}
