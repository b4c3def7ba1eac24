//! vLLM's P/D handoff legs as its proxy drives them: a prefill leg that publishes the
//! prompt's KV, and a decode leg that reads it.

use serde_json::{json, Value};

use super::completion;

/// The metric of KV blocks pinned for peers.
pub const PINNED: &str = "pdserve_kv_transfer_pinned_blocks";

/// The prefill leg of `prompt` (`do_remote_decode`), with `params` merged in.
pub fn prefill_leg(prompt: &str, params: Value) -> Value {
    let mut body = completion(prompt, json!({"max_tokens": 16}));
    let mut kv = json!({"do_remote_decode": true, "do_remote_prefill": false});
    if let Value::Object(extra) = params {
        kv.as_object_mut().unwrap().extend(extra);
    }
    kv["do_remote_decode"] = json!(true);
    kv["do_remote_prefill"] = json!(false);
    body["kv_transfer_params"] = kv;
    body
}

/// The decode leg of `prompt` reading the KV named by `params` (a prefill's answer).
pub fn decode_leg(prompt: &str, max_tokens: u32, params: &Value) -> Value {
    let mut body = completion(prompt, json!({"max_tokens": max_tokens}));
    body["kv_transfer_params"] = params.clone();
    body
}
