//! The request bodies the tests send and what they read back from the answers.

use serde_json::{json, Value};

/// A greedy completion request for `prompt` with `extra` fields.
pub fn completion(prompt: &str, extra: Value) -> Value {
    with_fields(
        json!({"model": "smollm2", "prompt": prompt, "temperature": 0}),
        extra,
    )
}

/// A greedy chat request with one user message and `extra` fields.
pub fn chat(content: &str, extra: Value) -> Value {
    with_fields(
        json!({
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
        }),
        extra,
    )
}

/// `body` with the fields of the object `extra` added (replacing any of the same name).
fn with_fields(mut body: Value, extra: Value) -> Value {
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The text of a completion answer's first choice.
pub fn text_of(answer: &Value) -> String {
    answer["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no completion text in {answer}"))
        .to_string()
}
