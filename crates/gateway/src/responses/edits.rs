//! What the gateway writes into the response objects a worker answers with, and what it
//! keeps of the finished one: the client's `previous_response_id` (a worker sent the
//! conversation written out does not know it), the prefill leg's cached-token count, and
//! for the next turn the answering worker, the conversation and the decode side's KV
//! handle.

use std::sync::Arc;

use pdserve_protocol::KvTransferParams;
use serde_json::{json, Value};

use crate::legs::sse::ResponseObjects;
use crate::sessions::conversation::ConversationCache;
use crate::sessions::response_chains::{ChainRecord, Conversation, ResponseChains};

/// The edits for one Responses answer.
#[derive(Debug)]
pub struct ResponseEdits {
    /// Where finished responses are remembered.
    pub chains: Arc<ResponseChains>,
    /// Where the decode side's final KV handle is kept for the next turn.
    pub conversations: Arc<ConversationCache>,
    /// The response this one continues, as the client named it.
    pub previous: Option<String>,
    /// The chain's first response id, when this is a later turn.
    pub root: Option<String>,
    /// The conversation before this turn, when the gateway knows all of it.
    pub before: Option<Arc<Conversation>>,
    /// Whether the gateway knows the whole conversation (false for a chain another
    /// gateway relayed, whose turns only its worker holds).
    pub history_known: bool,
    /// This turn's input items.
    pub input: Vec<Value>,
    /// Whether the client stores the response.
    pub store: bool,
    /// The prefill leg's prefix-cache hits, reported as the answer's cached tokens.
    pub cached_tokens: Option<u64>,
}

impl ResponseObjects for ResponseEdits {
    fn edit(
        &self,
        response: &mut Value,
        kv: Option<KvTransferParams>,
        finished: bool,
        worker: &str,
    ) {
        let Some(object) = response.as_object_mut() else {
            return;
        };
        if let Some(previous) = &self.previous {
            object.insert("previous_response_id".into(), json!(previous));
        }
        if !finished {
            return;
        }
        if let (Some(cached), Some(usage)) = (
            self.cached_tokens,
            object.get_mut("usage").and_then(Value::as_object_mut),
        ) {
            usage.insert(
                "input_tokens_details".into(),
                json!({ "cached_tokens": cached }),
            );
        }
        let failed = object.get("status").and_then(Value::as_str) == Some("failed");
        let Some(id) = object.get("id").and_then(Value::as_str) else {
            return;
        };
        if failed || !self.store {
            return;
        }
        let id = id.to_string();
        let mut items = self.input.clone();
        items.push(json!({"role": "assistant", "content": output_text(response)}));
        let record = ChainRecord {
            owner: worker.to_string(),
            root: self.root.clone().unwrap_or_else(|| id.clone()),
            previous: self.previous.clone(),
            conversation: self.history_known.then(|| {
                Arc::new(Conversation {
                    before: self.before.clone(),
                    items,
                })
            }),
        };
        if let Some(kv) = kv {
            self.conversations.put(&id, kv);
        }
        self.chains.put(id, record);
    }
}

/// The text of a response's output messages (what the next turn's prompt repeats as the
/// assistant's message).
fn output_text(response: &Value) -> String {
    let mut text = String::new();
    let items = response.get("output").and_then(Value::as_array);
    for item in items.into_iter().flatten() {
        if item.get("type").and_then(Value::as_str) != Some("message") {
            continue;
        }
        let parts = item.get("content").and_then(Value::as_array);
        for part in parts.into_iter().flatten() {
            if part.get("type").and_then(Value::as_str) == Some("output_text") {
                text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default());
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;
    use std::time::Duration;

    fn edits(previous: Option<&str>, store: bool) -> ResponseEdits {
        ResponseEdits {
            chains: Arc::new(ResponseChains::new(NonZeroUsize::new(8).unwrap())),
            conversations: Arc::new(ConversationCache::new(
                NonZeroUsize::new(8).unwrap(),
                Duration::from_secs(60),
            )),
            previous: previous.map(str::to_string),
            root: previous.map(|_| "resp_root".to_string()),
            before: None,
            history_known: true,
            input: vec![json!({"role": "user", "content": "q"})],
            store,
            cached_tokens: Some(7),
        }
    }

    fn finished() -> Value {
        json!({
            "id": "resp_2", "status": "completed", "previous_response_id": null,
            "output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "an"}, {"type": "output_text", "text": "swer"}]}],
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2}
        })
    }

    #[test]
    fn a_finished_response_is_kept_with_its_owner_conversation_and_handle() {
        let edits = edits(Some("resp_1"), true);
        let mut started =
            json!({"id": "resp_2", "status": "in_progress", "previous_response_id": null});
        edits.edit(&mut started, None, false, "http://w");
        assert_eq!(started["previous_response_id"], "resp_1");
        assert!(edits.chains.is_empty(), "nothing is kept before the end");
        let mut done = finished();
        let kv = KvTransferParams {
            remote_port: Some(9),
            ..KvTransferParams::default()
        };
        edits.edit(&mut done, Some(kv), true, "http://w");
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 7);
        let record = edits.chains.get("resp_2").unwrap();
        assert_eq!(record.owner, "http://w");
        assert_eq!(record.root, "resp_root");
        assert_eq!(record.previous.as_deref(), Some("resp_1"));
        let items = record.conversation.unwrap().items();
        assert_eq!(items[1], json!({"role": "assistant", "content": "answer"}));
        assert_eq!(
            edits.conversations.take("resp_2").unwrap().remote_port,
            Some(9)
        );
    }

    #[test]
    fn unstored_and_failed_responses_are_not_kept() {
        let edits = edits(None, false);
        edits.edit(&mut finished(), None, true, "http://w");
        assert!(edits.chains.is_empty());
        let edits = self::edits(None, true);
        let mut failed = finished();
        failed["status"] = json!("failed");
        edits.edit(&mut failed, None, true, "http://w");
        assert!(edits.chains.is_empty());
        edits.edit(&mut finished(), None, true, "http://w");
        assert_eq!(edits.chains.get("resp_2").unwrap().root, "resp_2");
    }
}
