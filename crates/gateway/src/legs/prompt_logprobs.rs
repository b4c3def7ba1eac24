//! Prompt (input) logprobs in every P/D mode: only the prefill worker computed the
//! prompt, so its scores are merged into the decode worker's answer, which lists the
//! prompt it imported without them.
//!
//! - SGLang's native format (`/generate` with `return_logprob`): P's
//!   `meta_info.input_token_logprobs` go in front of D's, as SGLang's router does (per
//!   item of a batch, in body and stream events alike).
//! - OpenAI completions (`logprobs` with `echo`, vLLM's `prompt_logprobs`): a decode
//!   worker echoes the prompt tokens without their logprobs (it never ran them); each
//!   `null` in D's `choices[i].logprobs.token_logprobs` (and `top_logprobs`) is filled
//!   from P's entry at the same position when both name the same token, and each `null`
//!   of D's `choices[i].prompt_logprobs` from P's.

use bytes::Bytes;
use serde_json::Value;

use super::sse::rewrite_events;

/// Whether a completions body asks for the prompt's logprobs (`echo` with `logprobs`,
/// or vLLM's `prompt_logprobs`), so P's answer must be merged into D's.
pub fn wants_prompt_logprobs(body: &serde_json::Map<String, Value>) -> bool {
    let echo = body.get("echo").and_then(Value::as_bool) == Some(true);
    let set = |key: &str| body.get(key).is_some_and(|v| !v.is_null());
    (echo && set("logprobs")) || set("prompt_logprobs")
}

/// [`wants_prompt_logprobs`] for a parsed request: only completions score prompts.
pub fn request_wants_prompt_logprobs(request: &crate::ingress::request::ClientRequest) -> bool {
    // Both counts are numbers the gateway forwards as written (held verbatim).
    let given = |name: &str| request.verbatim_number(name).is_some();
    match request {
        crate::ingress::request::ClientRequest::Completion(c) => {
            (c.echo == Some(true) && (c.logprobs.is_some() || given("logprobs")))
                || given("prompt_logprobs")
        }
        _ => false,
    }
}

/// The prefill worker's input logprobs, ready to merge into the decode worker's answer.
#[derive(Debug, Clone)]
pub struct PrefillLogprobs {
    /// P's answer: an object, or (native batch) a list of objects.
    answer: Value,
}

impl PrefillLogprobs {
    /// P's answer body (JSON; for a stream answer, its last event that carries logprobs).
    pub fn from_answer(body: &[u8]) -> Self {
        let answer = serde_json::from_slice(body).unwrap_or_else(|_| last_event(body));
        Self { answer }
    }

    /// Merges into D's whole JSON body; an unparsable body is returned unchanged.
    pub fn merge_body(&self, body: Bytes) -> Bytes {
        let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
            return body;
        };
        self.merge_value(&mut value, None);
        serde_json::to_vec(&value).map_or(body, Bytes::from)
    }

    /// Merges into every `data:` event of a chunk of whole SSE lines.
    pub fn merge_events(&self, lines: Bytes) -> Bytes {
        if memchr::memmem::find(&lines, b"logprob").is_none() {
            return lines;
        }
        rewrite_events(&lines, 256, |data| {
            if data.first() != Some(&b'{') {
                return None;
            }
            let mut v = serde_json::from_slice::<Value>(data.trim_ascii_end()).ok()?;
            // A stream event carries one item; SGLang names it by `index`.
            let index = v.get("index").and_then(Value::as_u64);
            self.merge_value(&mut v, index.map(|i| i as usize));
            serde_json::to_vec(&v).ok()
        })
    }

    /// Merges into one decoded value: a native item, a native batch, or an OpenAI body.
    fn merge_value(&self, decode: &mut Value, item: Option<usize>) {
        match decode {
            Value::Array(items) => {
                for (i, d) in items.iter_mut().enumerate() {
                    if let Some(p) = self.native_item(Some(i)) {
                        merge_native(p, d);
                    }
                }
            }
            Value::Object(o) if o.contains_key("meta_info") => {
                if let Some(p) = self.native_item(item) {
                    merge_native(p, decode);
                }
            }
            Value::Object(o) if o.contains_key("choices") => self.merge_openai(decode),
            _ => {}
        }
    }

    /// P's native item `i` (a batch answer is a list; a single answer serves item 0).
    fn native_item(&self, i: Option<usize>) -> Option<&Value> {
        match (&self.answer, i) {
            (Value::Array(items), i) => items.get(i.unwrap_or(0)),
            (single, None | Some(0)) => Some(single),
            _ => None,
        }
    }

    fn merge_openai(&self, decode: &mut Value) {
        let Some(choices) = decode.get_mut("choices").and_then(Value::as_array_mut) else {
            return;
        };
        for choice in choices {
            let index = choice.get("index").cloned().unwrap_or(Value::from(0));
            let prefill = self
                .answer
                .get("choices")
                .and_then(Value::as_array)
                .and_then(|cs| cs.iter().find(|c| c.get("index") == Some(&index)));
            let Some(prefill) = prefill else { continue };
            if let (Some(p), Some(d)) = (prefill.get("logprobs"), choice.get_mut("logprobs")) {
                fill_openai(p, d);
            }
            let listed = prefill.get("prompt_logprobs").and_then(Value::as_array);
            if let (Some(p), Some(Value::Array(d))) = (listed, choice.get_mut("prompt_logprobs")) {
                for (d, p) in d.iter_mut().zip(p) {
                    if d.is_null() {
                        *d = p.clone();
                    }
                }
            }
        }
    }
}

/// SGLang's rule: P's `input_token_logprobs` (and `input_top_logprobs`) before D's.
fn merge_native(prefill: &Value, decode: &mut Value) {
    let Some(d_meta) = decode.get_mut("meta_info").and_then(Value::as_object_mut) else {
        return;
    };
    for key in ["input_token_logprobs", "input_top_logprobs"] {
        let p = prefill
            .get("meta_info")
            .and_then(|m| m.get(key))
            .and_then(Value::as_array);
        if let (Some(p), Some(Value::Array(d))) = (p, d_meta.get_mut(key)) {
            let mut merged = p.clone();
            merged.append(d);
            *d = merged;
        }
    }
}

/// Fills D's missing prompt logprobs from P's, position by position, where the tokens
/// agree.
fn fill_openai(prefill: &Value, decode: &mut Value) {
    let p_tokens = prefill.get("tokens").and_then(Value::as_array);
    let d_tokens = decode.get("tokens").and_then(Value::as_array).cloned();
    let (Some(p_tokens), Some(d_tokens)) = (p_tokens, d_tokens) else {
        return;
    };
    for key in ["token_logprobs", "top_logprobs"] {
        let Some(p_values) = prefill.get(key).and_then(Value::as_array) else {
            continue;
        };
        let Some(d_values) = decode.get_mut(key).and_then(Value::as_array_mut) else {
            continue;
        };
        for (j, d_value) in d_values.iter_mut().enumerate() {
            let same_token = p_tokens.get(j).is_some() && p_tokens.get(j) == d_tokens.get(j);
            if d_value.is_null() && same_token {
                if let Some(p_value) = p_values.get(j) {
                    *d_value = p_value.clone();
                }
            }
        }
    }
}

/// The last JSON `data:` event of an SSE body (a prefill worker that streamed).
fn last_event(body: &[u8]) -> Value {
    body.split(|&b| b == b'\n')
        .rev()
        .filter_map(|line| line.strip_prefix(b"data:"))
        .filter_map(|p| serde_json::from_slice::<Value>(p.trim_ascii()).ok())
        .find(|v| v.is_object())
        .unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lp(id: u64) -> Value {
        json!([-0.5, id, null])
    }

    #[test]
    fn native_body_batch_and_events_get_prefill_logprobs_first() {
        let p = PrefillLogprobs::from_answer(
            json!({"text": "x", "meta_info": {"input_token_logprobs": [lp(1), lp(2)]}})
                .to_string()
                .as_bytes(),
        );
        let d = json!({"text": "yz", "meta_info": {"input_token_logprobs": [lp(3)]}});
        let merged: Value =
            serde_json::from_slice(&p.merge_body(Bytes::from(d.to_string()))).unwrap();
        assert_eq!(
            merged["meta_info"]["input_token_logprobs"],
            json!([lp(1), lp(2), lp(3)])
        );
        let event = format!("data: {d}\n\ndata: [DONE]\n\n");
        let out = p.merge_events(Bytes::from(event));
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(text.ends_with("\n\ndata: [DONE]\n\n"), "{text}");
        let first: Value = serde_json::from_str(&text[6..text.find("\n\n").unwrap()]).unwrap();
        assert_eq!(
            first["meta_info"]["input_token_logprobs"]
                .as_array()
                .unwrap()
                .len(),
            3
        );

        let p = PrefillLogprobs::from_answer(
            json!([{"meta_info": {"input_token_logprobs": [lp(1)]}},
                   {"meta_info": {"input_token_logprobs": [lp(5)]}}])
            .to_string()
            .as_bytes(),
        );
        let d = json!([{"meta_info": {"input_token_logprobs": []}},
                       {"meta_info": {"input_token_logprobs": [lp(6)]}}]);
        let merged: Value =
            serde_json::from_slice(&p.merge_body(Bytes::from(d.to_string()))).unwrap();
        assert_eq!(
            merged[0]["meta_info"]["input_token_logprobs"],
            json!([lp(1)])
        );
        assert_eq!(
            merged[1]["meta_info"]["input_token_logprobs"],
            json!([lp(5), lp(6)])
        );
    }

    #[test]
    fn openai_echo_prompt_logprobs_are_filled_from_prefill() {
        let p = PrefillLogprobs::from_answer(
            json!({"choices": [{"index": 0, "text": "a b c", "logprobs": {
                "tokens": ["a", " b", " c"], "token_logprobs": [null, -1.0, -2.0],
                "top_logprobs": [null, {" b": -1.0}, {" c": -2.0}], "text_offset": [0, 1, 3]}}]})
            .to_string()
            .as_bytes(),
        );
        let d = json!({"choices": [{"index": 0, "text": "a b d", "logprobs": {
            "tokens": ["a", " b", " d"], "token_logprobs": [null, null, -0.1],
            "top_logprobs": [null, null, {" d": -0.1}], "text_offset": [0, 1, 3]}}]});
        let merged: Value =
            serde_json::from_slice(&p.merge_body(Bytes::from(d.to_string()))).unwrap();
        let logprobs = &merged["choices"][0]["logprobs"];
        assert_eq!(logprobs["token_logprobs"], json!([null, -1.0, -0.1]));
        assert_eq!(logprobs["top_logprobs"][1], json!({" b": -1.0}));
        assert_eq!(logprobs["top_logprobs"][2], json!({" d": -0.1}));
    }

    #[test]
    fn vllm_prompt_logprobs_are_filled_from_prefill() {
        let p = PrefillLogprobs::from_answer(
            json!({"choices": [{"index": 0, "prompt_logprobs": [null, {"5": {"logprob": -1.0}}]}]})
                .to_string()
                .as_bytes(),
        );
        let d = json!({"choices": [{"index": 0, "prompt_logprobs": [null, null]}]});
        let merged: Value =
            serde_json::from_slice(&p.merge_body(Bytes::from(d.to_string()))).unwrap();
        assert_eq!(
            merged["choices"][0]["prompt_logprobs"],
            json!([null, {"5": {"logprob": -1.0}}])
        );
        let object = |v: Value| v.as_object().unwrap().clone();
        assert!(wants_prompt_logprobs(&object(
            json!({"echo": true, "logprobs": 0})
        )));
        assert!(wants_prompt_logprobs(&object(
            json!({"prompt_logprobs": 1})
        )));
        assert!(!wants_prompt_logprobs(&object(json!({"logprobs": 2}))));
        assert!(!wants_prompt_logprobs(&object(
            json!({"echo": true, "prompt_logprobs": null})
        )));
    }
}
