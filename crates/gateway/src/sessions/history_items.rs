//! Items as the history keeps them: a client's item completed the way OpenAI returns it
//! (a `type`, a message's text as content parts, a `status`), and a stored chain written
//! out as the input items of its next turn.

// The checks return the handler's OpenAI-shaped error itself, built once per rejected
// request.
#![allow(clippy::result_large_err)]

use pdserve_history::{HistoryError, StoredResponse};
use pdserve_protocol::ApiError;
use serde_json::{json, Value};

/// `item` (the client's, at `at`, e.g. `items[3]`) as the history keeps it: a `type`
/// (a message when none is given); a message needs a `role`, and its text content becomes
/// one `input_text` part (`output_text` for the assistant) with `status` `completed`.
pub fn shape_item(item: &Value, at: &str) -> Result<Value, ApiError> {
    let Value::Object(fields) = item else {
        return Err(ApiError::bad_request(format!("'{at}' must be an object.")).with_param(at));
    };
    let mut fields = fields.clone();
    let kind = match fields.get("type") {
        None => "message",
        Some(Value::String(kind)) => kind.as_str(),
        Some(_) => {
            return Err(
                ApiError::bad_request(format!("'{at}.type' must be a string."))
                    .with_param(format!("{at}.type")),
            )
        }
    }
    .to_string();
    if kind == "message" {
        if !fields.get("role").is_some_and(Value::is_string) {
            return Err(
                ApiError::bad_request(format!("Missing required parameter: '{at}.role'."))
                    .with_param(format!("{at}.role")),
            );
        }
        if let Some(Value::String(text)) = fields.get("content") {
            let part = match fields.get("role").and_then(Value::as_str) {
                Some("assistant") => {
                    json!({"type": "output_text", "text": text, "annotations": []})
                }
                _ => json!({"type": "input_text", "text": text}),
            };
            fields.insert("content".into(), Value::Array(vec![part]));
        }
        fields
            .entry("status")
            .or_insert_with(|| Value::from("completed"));
    }
    fields.insert("type".into(), Value::from(kind));
    if fields.get("id").is_some_and(|id| !id.is_string()) {
        return Err(
            ApiError::bad_request(format!("'{at}.id' must be a string."))
                .with_param(format!("{at}.id")),
        );
    }
    Ok(Value::Object(fields))
}

/// Every turn of `chain` (oldest first) as input items: each turn's input, then its
/// output, as the next turn's prompt repeats them.
pub fn chain_items(chain: &[StoredResponse]) -> Vec<Value> {
    let mut items = Vec::new();
    for turn in chain {
        items.extend(turn.input.iter().cloned());
        items.extend(turn.output());
    }
    items
}

/// A store error as the client sees it: 503 when the store is unavailable.
pub fn store_error(error: HistoryError) -> ApiError {
    match error {
        HistoryError::DuplicateItem(_) => {
            ApiError::bad_request(error.to_string()).with_param("items")
        }
        HistoryError::UnknownCursor(_) => {
            ApiError::bad_request(error.to_string()).with_param("after")
        }
        HistoryError::ConversationGone(_) => ApiError::not_found(error.to_string()),
        HistoryError::Json(_) => ApiError::internal(error.to_string()),
        HistoryError::Unavailable(_)
        | HistoryError::Open { .. }
        | HistoryError::NewerSchema { .. } => ApiError::service_unavailable(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_messages_become_parts_as_openai_returns_them() {
        let user = shape_item(&json!({"role": "user", "content": "hi"}), "items[0]").unwrap();
        assert_eq!(user["type"], "message");
        assert_eq!(user["status"], "completed");
        assert_eq!(
            user["content"][0],
            json!({"type": "input_text", "text": "hi"})
        );
        let answer = shape_item(&json!({"role": "assistant", "content": "yo"}), "x").unwrap();
        assert_eq!(answer["content"][0]["type"], "output_text");
        assert_eq!(answer["content"][0]["annotations"], json!([]));
        let call = json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"});
        assert_eq!(shape_item(&call, "x").unwrap(), call);
    }

    #[test]
    fn bad_items_name_where_they_are() {
        let no_role = shape_item(&json!({"content": "hi"}), "items[2]").unwrap_err();
        assert_eq!(no_role.body.error.param.as_deref(), Some("items[2].role"));
        let not_object = shape_item(&json!("hi"), "input[0]").unwrap_err();
        assert_eq!(not_object.body.error.param.as_deref(), Some("input[0]"));
        let bad_id = shape_item(&json!({"role": "user", "id": 3}), "items[0]").unwrap_err();
        assert_eq!(bad_id.body.error.param.as_deref(), Some("items[0].id"));
    }

    #[test]
    fn a_chain_is_each_turns_input_then_output() {
        let turn = |n: u32| StoredResponse {
            id: format!("resp_{n}"),
            previous_response_id: None,
            conversation_id: None,
            created_at: 0,
            input: vec![json!({"role": "user", "content": format!("q{n}")})],
            response: json!({"output": [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": format!("a{n}")}]}]}),
            kv_route: None,
        };
        let items = chain_items(&[turn(1), turn(2)]);
        let texts: Vec<String> = items
            .iter()
            .map(|i| {
                i["content"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| i["content"][0]["text"].as_str().unwrap().to_string())
            })
            .collect();
        assert_eq!(texts, ["q1", "a1", "q2", "a2"]);
    }
}
