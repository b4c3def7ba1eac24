//! What the gateway writes into the response objects a worker answers with, and what it
//! keeps of the finished one: the client's `previous_response_id` and `conversation` (a
//! worker sent the conversation written out knows neither), the prefill leg's
//! cached-token count, and, in the history store, the turn itself with the answering
//! worker and the decode side's KV handle for the next turn.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use pdserve_history::{HistoryStore, StoredResponse};
use pdserve_protocol::KvTransferParams;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use crate::legs::sse::ResponseObjects;
use crate::serving::metrics::ServingMetrics;
use crate::sessions::conversation::ConversationCache;

/// The edits for one Responses answer.
#[derive(Debug)]
pub struct ResponseEdits {
    /// Where finished turns are stored.
    pub history: HistoryStore,
    /// Where the decode side's final KV handle is kept for this gateway's next turn.
    pub conversations: Arc<ConversationCache>,
    /// Counts the history's writes.
    pub metrics: Arc<ServingMetrics>,
    /// The response this one continues, as the client named it.
    pub previous: Option<String>,
    /// The conversation this turn is appended to.
    pub conversation: Option<String>,
    /// Whether the gateway knows the whole conversation (false for a chain only a
    /// worker holds: storing this turn here would cut the chain short).
    pub history_known: bool,
    /// This turn's input items, as the history keeps them.
    pub input: Vec<Value>,
    /// Whether the client stores the response.
    pub store: bool,
    /// The prefill leg's prefix-cache hits, reported as the answer's cached tokens.
    pub cached_tokens: Option<u64>,
    /// The finished turn's write, which the client's last bytes wait for.
    pub pending: Mutex<Option<JoinHandle<()>>>,
}

impl ResponseEdits {
    /// Starts storing the finished `response` (answered by `worker`), in the background:
    /// [`ResponseObjects::flush`] waits for it.
    fn keep(&self, response: &Value, kv: Option<&KvTransferParams>, worker: &str) {
        let Some(id) = response.get("id").and_then(Value::as_str) else {
            return;
        };
        if let Some(kv) = kv {
            self.conversations.put(id, kv.clone());
        }
        if !self.history_known || !self.history.enabled() {
            return;
        }
        let output = response
            .get("output")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let turn = StoredResponse {
            id: id.to_string(),
            previous_response_id: self.previous.clone(),
            conversation_id: self.conversation.clone(),
            created_at: pdserve_history::store::unix_now(),
            input: self.input.clone(),
            response: response.clone(),
            kv_route: Some(json!({
                "worker": worker,
                "kv_transfer_params": kv,
                "stored_at_ms": unix_millis(),
            })),
        };
        let (history, metrics, store) = (self.history.clone(), self.metrics.clone(), self.store);
        let write = tokio::spawn(async move {
            let started = std::time::Instant::now();
            let result = match (&turn.conversation_id, store) {
                (_, true) => history.put_response(turn.clone()).await,
                (Some(conversation), false) => {
                    let mut items = turn.input.clone();
                    items.extend(output);
                    history.add_items(conversation, items).await.map(|_| ())
                }
                (None, false) => return,
            };
            metrics.observe_history("write", started.elapsed(), result.is_ok());
            if let Err(e) = result {
                tracing::warn!(
                    response_id = turn.id,
                    "the turn was answered but not stored: {e}"
                );
            }
        });
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(write);
    }
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
        if let Some(conversation) = &self.conversation {
            object.insert("conversation".into(), json!({ "id": conversation }));
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
        if failed || !(self.store || self.conversation.is_some()) {
            return;
        }
        self.keep(response, kv.as_ref(), worker);
    }

    fn flush(&self) -> BoxFuture<'_, ()> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        Box::pin(async move {
            if let Some(write) = pending {
                let _ = write.await;
            }
        })
    }
}

/// Milliseconds since the Unix epoch.
fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The decode side's KV handle a stored turn kept, and the worker that holds it, while it
/// is younger than `ttl` (past it the worker has freed the blocks).
pub fn stored_handle(
    turn: &StoredResponse,
    ttl: std::time::Duration,
) -> (Option<String>, Option<KvTransferParams>) {
    let Some(route) = &turn.kv_route else {
        return (None, None);
    };
    let worker = route
        .get("worker")
        .and_then(Value::as_str)
        .map(str::to_string);
    let fresh = route
        .get("stored_at_ms")
        .and_then(Value::as_u64)
        .is_some_and(|at| unix_millis().saturating_sub(at) <= ttl.as_millis() as u64);
    let kv = route
        .get("kv_transfer_params")
        .filter(|kv| fresh && !kv.is_null())
        .and_then(|kv| serde_json::from_value(kv.clone()).ok());
    (worker, kv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;
    use std::time::Duration;

    fn edits(previous: Option<&str>, store: bool) -> ResponseEdits {
        let history = HistoryStore::open(pdserve_history::HistoryOptions {
            backend: pdserve_history::HistoryBackend::Memory,
            url: None,
            retention: Duration::ZERO,
            max_responses: 100,
            max_conversations: 100,
            timeout: Duration::from_secs(5),
        })
        .unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let history_series = Arc::new(crate::observe::history::History::default());
        ResponseEdits {
            history,
            conversations: Arc::new(ConversationCache::new(
                NonZeroUsize::new(8).unwrap(),
                Duration::from_secs(60),
            )),
            metrics: Arc::new(ServingMetrics::register(&mut registry, history_series)),
            previous: previous.map(str::to_string),
            conversation: None,
            history_known: true,
            input: vec![json!({"type": "message", "role": "user", "content": "q"})],
            store,
            cached_tokens: Some(7),
            pending: Mutex::new(None),
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

    #[tokio::test]
    async fn a_finished_response_is_stored_with_its_worker_and_handle() {
        let edits = edits(Some("resp_1"), true);
        let mut started =
            json!({"id": "resp_2", "status": "in_progress", "previous_response_id": null});
        edits.edit(&mut started, None, false, "http://w");
        assert_eq!(started["previous_response_id"], "resp_1");
        edits.flush().await;
        assert!(edits.history.response("resp_2").await.unwrap().is_none());
        let mut done = finished();
        let kv = KvTransferParams {
            remote_port: Some(9),
            ..KvTransferParams::default()
        };
        edits.edit(&mut done, Some(kv), true, "http://w");
        edits.flush().await;
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 7);
        let stored = edits.history.response("resp_2").await.unwrap().unwrap();
        assert_eq!(stored.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(stored.response, done, "stored as the client got it");
        assert_eq!(stored.input[0]["content"], "q");
        let (worker, handle) = stored_handle(&stored, Duration::from_secs(60));
        assert_eq!(worker.as_deref(), Some("http://w"));
        assert_eq!(handle.unwrap().remote_port, Some(9));
        assert_eq!(
            edits.conversations.take("resp_2").unwrap().remote_port,
            Some(9)
        );
    }

    #[tokio::test]
    async fn unstored_failed_and_worker_held_responses_are_not_stored() {
        let edits = edits(None, false);
        edits.edit(&mut finished(), None, true, "http://w");
        edits.flush().await;
        assert!(edits.history.response("resp_2").await.unwrap().is_none());
        let edits = self::edits(None, true);
        let mut failed = finished();
        failed["status"] = json!("failed");
        edits.edit(&mut failed, None, true, "http://w");
        edits.flush().await;
        assert!(edits.history.response("resp_2").await.unwrap().is_none());
        let mut worker_held = self::edits(Some("resp_1"), true);
        worker_held.history_known = false;
        worker_held.edit(&mut finished(), None, true, "http://w");
        worker_held.flush().await;
        assert!(worker_held
            .history
            .response("resp_2")
            .await
            .unwrap()
            .is_none());
        edits.edit(&mut finished(), None, true, "http://w");
        edits.flush().await;
        assert!(edits.history.response("resp_2").await.unwrap().is_some());
    }
}
