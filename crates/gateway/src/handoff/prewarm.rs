//! `--prewarm`: one tiny request through every prefill/decode pair (or prefill_decode
//! worker) as it becomes routable, so the first user request does not pay connection and
//! KV-transfer set-up.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdserve_protocol::{KvTransferParams, WorkerRole};
use serde_json::{json, Value};

use crate::clients::worker_client::{Exchange, ForwardHeaders, LegFault};
use crate::endpoint::Endpoint;
use crate::fleet::registry::{Roster, Worker};
use crate::serving::Serving;

/// Time between attempts to warm a pair.
const RETRY_EVERY: Duration = Duration::from_secs(5);
/// Attempts per pair before giving up.
const MAX_ATTEMPTS: u32 = 60;

/// A routable path: a prefill and a decode worker, or one prefill_decode worker.
#[derive(Debug, Clone)]
struct Path {
    prefill: Option<Arc<Worker>>,
    decode: Arc<Worker>,
}

impl Path {
    fn key(&self) -> (String, String) {
        let p = self
            .prefill
            .as_ref()
            .map(|w| w.base.clone())
            .unwrap_or_default();
        (p, self.decode.base.clone())
    }

    fn describe(&self) -> String {
        match &self.prefill {
            Some(p) => format!("{} -> {}", p.base, self.decode.base),
            None => self.decode.base.clone(),
        }
    }
}

fn routable_paths(roster: &Roster) -> Vec<Path> {
    let mut paths = Vec::new();
    for d in roster.live(WorkerRole::Decode) {
        for p in roster.live(WorkerRole::Prefill) {
            paths.push(Path {
                prefill: Some(p.clone()),
                decode: d.clone(),
            });
        }
    }
    for w in roster.live(WorkerRole::PrefillDecode) {
        paths.push(Path {
            prefill: None,
            decode: w.clone(),
        });
    }
    paths
}

/// Watches the registry and warms each path once per appearance: a path whose worker
/// is evicted or removed is warmed again when it comes back.
pub fn spawn(state: Arc<Serving>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut changes = state.registry.subscribe();
        let mut warming: HashMap<(String, String), tokio::task::JoinHandle<()>> = HashMap::new();
        loop {
            let paths = routable_paths(&state.registry.snapshot());
            let current: Vec<_> = paths.iter().map(Path::key).collect();
            warming.retain(|key, task| {
                let keep = current.contains(key);
                if !keep {
                    task.abort();
                }
                keep
            });
            for path in paths {
                warming
                    .entry(path.key())
                    .or_insert_with(|| tokio::spawn(warm(state.clone(), path)));
            }
            if changes.changed().await.is_err() {
                break;
            }
        }
        for task in warming.values() {
            task.abort();
        }
    })
}

async fn warm(state: Arc<Serving>, path: Path) {
    for attempt in 1..=MAX_ATTEMPTS {
        match warm_once(&state, &path).await {
            Ok(()) => {
                tracing::info!(path = %path.describe(), "pre-warmed");
                return;
            }
            Err(why) => tracing::warn!(
                path = %path.describe(),
                "pre-warm attempt {attempt}/{MAX_ATTEMPTS} failed: {why}"
            ),
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
    tracing::warn!(path = %path.describe(), "giving up pre-warming after {MAX_ATTEMPTS} attempts");
}

/// Sends `" x"` for one token through the path, the way a user request would go.
async fn warm_once(state: &Serving, path: &Path) -> Result<(), String> {
    let headers = ForwardHeaders::from_client(&http::HeaderMap::new());
    let model = served_model(state, &path.decode, &headers).await?;
    let mut body = json!({"model": model, "prompt": " x", "max_tokens": 1, "stream": false});
    if let Some(prefill) = &path.prefill {
        body["kv_transfer_params"] = json!(KvTransferParams::prefill_request());
        let answer = post(state, prefill, "prefill worker", &body, &headers).await?;
        body["kv_transfer_params"] = answer
            .get("kv_transfer_params")
            .cloned()
            .unwrap_or(Value::Null);
    }
    let label = if path.prefill.is_some() {
        "decode worker"
    } else {
        "prefill_decode worker"
    };
    post(state, &path.decode, label, &body, &headers).await?;
    Ok(())
}

/// The first model id the worker lists.
async fn served_model(
    state: &Serving,
    worker: &Worker,
    headers: &ForwardHeaders,
) -> Result<String, String> {
    let exchange = Exchange::new(worker, "worker", state.settings.decode_timeout);
    let body = exchange
        .send_and_read(state.client.get(worker.models_url(), headers))
        .await
        .map_err(|e| e.failure_message())?;
    let list: Value = serde_json::from_slice(&body).map_err(|e| format!("/v1/models: {e}"))?;
    list["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| "/v1/models lists no model".to_string())
}

async fn post(
    state: &Serving,
    worker: &Worker,
    label: &str,
    body: &Value,
    headers: &ForwardHeaders,
) -> Result<Value, String> {
    let limit = state.settings.prefill_timeout;
    let exchange = Exchange::new(worker, label, limit);
    let request = state.client.post_json(
        worker.url(Endpoint::Completions),
        Bytes::from(body.to_string()),
        headers,
    );
    let answer = exchange
        .send_and_read(request)
        .await
        .map_err(|e| e.failure_message())?;
    serde_json::from_slice(&answer).map_err(|e| {
        exchange
            .error(LegFault::Failed, format!("answered non-JSON: {e}"))
            .failure_message()
    })
}
