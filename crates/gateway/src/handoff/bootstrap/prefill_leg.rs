//! P's leg of a bootstrap attempt: a task of its own, so that it progresses while D's
//! bytes are relayed, and the check that its answer can be trusted.

use std::sync::Arc;

use bytes::Bytes;
use pdserve_protocol::ApiError;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::leg::{final_error, leg_request, reported};
use crate::clients::worker_client::LegError;
use crate::fleet::registry::Worker;
use crate::handoff::sglang_route::SglangRoute;
use crate::legs::first_token_watch::FirstTokenWatch;
use crate::legs::prefill::send_prefill;
use crate::legs::RequestContext;
use crate::serving::Serving;

/// P's leg, running as a task of its own so that it progresses while D's bytes are
/// relayed; dropping it aborts the task, which closes P's connection.
pub(super) struct PrefillLeg {
    task: Option<JoinHandle<Result<Bytes, LegError>>>,
    head: Option<oneshot::Receiver<()>>,
    /// P's 2xx body, once it answered.
    body: Option<Bytes>,
    worker: Arc<Worker>,
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            tracing::debug!(worker = %self.worker.base, "aborting the prefill leg");
            task.abort();
        }
    }
}

impl PrefillLeg {
    pub(super) fn spawn(
        state: &Arc<Serving>,
        ctx: &RequestContext,
        route: SglangRoute,
        worker: Arc<Worker>,
        body: Bytes,
        mut watch: Option<FirstTokenWatch>,
    ) -> Self {
        let (head_tx, head_rx) = oneshot::channel();
        let state = state.clone();
        let ctx = ctx.clone();
        let leg_worker = worker.clone();
        let task = tokio::spawn(async move {
            let worker = leg_worker;
            let span =
                crate::observe::trace::leg(ctx.trace.as_ref(), "prefill", &worker, &worker.base);
            let request = leg_request(&state, &ctx, route, &worker, body, span.as_ref());
            let on = watch.is_some();
            let mut push = |chunk: &Bytes| {
                if let Some(watch) = watch.as_mut() {
                    watch.push(chunk);
                }
            };
            let watching = on.then_some(&mut push as &mut (dyn FnMut(&Bytes) + Send));
            let result = send_prefill(&state, &worker, request, Some(head_tx), watching, |body| {
                check_prefill_answer(body).map(|()| body.clone())
            })
            .await;
            crate::observe::trace::leg_done(span, &result);
            if let Err(e) = &result {
                state.report(&worker, e);
                state.forget_unsent(&worker, ctx.prompt_tokens.as_deref(), e);
            }
            result.map_err(reported)
        });
        Self {
            task: Some(task),
            head: Some(head_rx),
            body: None,
            worker,
        }
    }

    /// Whether P has not answered yet.
    pub(super) fn is_pending(&self) -> bool {
        self.task.is_some()
    }

    /// P's 2xx body, once it succeeded.
    pub(super) fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }

    /// Waits for P's outcome; returns its failure (once), or `None` once it succeeded.
    pub(super) async fn failure(&mut self) -> Option<LegError> {
        let task = self.task.as_mut()?;
        let joined = task.await;
        self.task = None;
        match joined {
            Ok(Ok(body)) => {
                self.body = Some(body);
                None
            }
            Ok(Err(e)) => Some(e),
            Err(e) => Some(final_error(ApiError::bad_gateway(format!(
                "prefill leg to {} ended: {e}",
                self.worker.base
            )))),
        }
    }

    /// Waits until P's response head arrived (`--sglang-wait-prefill-head`) or P failed.
    pub(super) async fn wait_head(&mut self) -> Option<LegError> {
        if let Some(head) = self.head.take() {
            if head.await.is_ok() {
                return None;
            }
        }
        self.failure().await
    }
}

/// A prefill worker's 2xx body must be a JSON answer or an event stream without an error
/// event; anything else means its KV cannot be trusted.
fn check_prefill_answer(body: &[u8]) -> Result<(), String> {
    let has_error = |v: &Value| v.get("error").is_some_and(|e| !e.is_null());
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        return match value {
            Value::Object(_) | Value::Array(_) if !has_error(&value) => Ok(()),
            _ => Err(format!(
                "answered 200 with an error or a non-object: {}",
                crate::error::truncate(&String::from_utf8_lossy(body), 512)
            )),
        };
    }
    let mut events = 0;
    for line in body.split(|&b| b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            continue;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) if !has_error(&v) => events += 1,
            Ok(v) => return Err(format!("streamed an error event: {v}")),
            Err(_) => break,
        }
    }
    if events == 0 {
        let text = String::from_utf8_lossy(body);
        return Err(format!(
            "answered 200 with a body that is neither JSON nor an event stream: {}",
            crate::error::truncate(text.trim(), 512)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_answers_are_checked() {
        assert!(check_prefill_answer(br#"{"text":"x","meta_info":{}}"#).is_ok());
        assert!(check_prefill_answer(br#"[{"text":"x"}]"#).is_ok());
        assert!(check_prefill_answer(b"data: {\"a\":1}\n\ndata: [DONE]\n\n").is_ok());
        assert!(check_prefill_answer(b"<html>502 proxy error").is_err());
        assert!(check_prefill_answer(b"").is_err());
        assert!(check_prefill_answer(br#"{"error":{"message":"x"}}"#).is_err());
        assert!(check_prefill_answer(b"data: {\"error\":{\"message\":\"x\"}}\n\n").is_err());
    }
}
