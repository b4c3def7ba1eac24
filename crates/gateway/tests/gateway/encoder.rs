//! A test double of a vLLM encode instance (EPD disaggregation): it answers an encoder
//! sub-request as vLLM's encoder does, with `ec_transfer_params` naming, per published
//! embedding, its `metadata`, its position in the sub-request (`item_indices`) and the
//! connector's handles; records every request; fails on demand.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::sync::Notify;

/// Builds an encoder's `ec_transfer_params` from the sub-request body.
pub type Reply = Arc<dyn Fn(&Value) -> Value + Send + Sync>;

/// How the encoder answers the next sub-requests.
#[derive(Clone)]
pub enum Behavior {
    /// Like vLLM: one entry per item, keyed by its uuid (or its URL when it has none).
    Normal,
    /// 200 without `ec_transfer_params` (an encoder that reports nothing).
    Silent,
    /// 200 with these `ec_transfer_params`, built from the body.
    Custom(Reply),
    /// This status and body.
    Status(u16, &'static str),
    /// Never answer (recorded as cancelled when the gateway drops the request); signals
    /// (`notify_one`) once the sub-request is being held.
    HoldSignalling(Arc<Notify>),
    /// This status and body once the signal came (e.g. another encoder holds its part).
    StatusAfter(u16, &'static str, Arc<Notify>),
}

/// One sub-request as the encoder received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub headers: HeaderMap,
    pub body: Value,
}

struct Shared {
    name: String,
    behavior: Mutex<Behavior>,
    requests: Mutex<Vec<Recorded>>,
    cancelled: AtomicUsize,
    cancelled_notify: Notify,
}

/// A running encoder double on 127.0.0.1, on a runtime of its own.
pub struct Encoder {
    pub url: String,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Encoder {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Encoder {
    /// Starts an encoder named `name` (used in its connector handles).
    pub async fn start(name: &str) -> Self {
        let shared = Arc::new(Shared {
            name: name.to_string(),
            behavior: Mutex::new(Behavior::Normal),
            requests: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
            cancelled_notify: Notify::new(),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let app = Router::new()
            .route("/v1/chat/completions", post(encode))
            .route("/health", get(|| async { "ok" }))
            .with_state(shared.clone());
        let listener = {
            let _context = runtime.enter();
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            socket.listen(1024).unwrap()
        };
        let addr = listener.local_addr().unwrap();
        runtime.spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            url: format!("http://{addr}"),
            shared,
            runtime: Some(runtime),
        }
    }

    /// Sets how the next sub-requests are answered.
    pub fn set(&self, behavior: Behavior) {
        *self.shared.behavior.lock().unwrap() = behavior;
    }

    /// Every sub-request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The items (content parts) of each sub-request received so far.
    pub fn item_batches(&self) -> Vec<Vec<Value>> {
        self.requests().iter().map(|r| items_of(&r.body)).collect()
    }

    /// Sub-requests dropped by the gateway before they were answered.
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    /// Waits until a sub-request has been dropped by the gateway.
    pub async fn wait_for_cancel(&self) {
        loop {
            let notified = self.shared.cancelled_notify.notified();
            if self.cancelled() > 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The content parts of a sub-request's one message.
pub fn items_of(body: &Value) -> Vec<Value> {
    body["messages"][0]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The metadata this double reports for an item of `kind` (what vLLM's processors put
/// in: the grid for images and videos, feature lengths for audio).
pub fn metadata_for(kind: &str) -> Value {
    match kind {
        "image_url" => json!({"image_grid_thw": [[1, 4, 6]]}),
        "video_url" => json!({"video_grid_thw": [[2, 4, 4]], "second_per_grid_ts": [0.5]}),
        _ => json!({"audio_feature_lengths": [[25]]}),
    }
}

/// vLLM's answer: per item, keyed by its uuid, its metadata, position and handles.
fn normal_params(name: &str, body: &Value) -> Value {
    let mut params = Map::new();
    for (position, item) in items_of(body).iter().enumerate() {
        let kind = item["type"].as_str().unwrap_or("");
        let key = item["uuid"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| {
                // Without a uuid the engine hashes the item itself.
                format!(
                    "{name}-hash-{}",
                    item[kind]["url"].as_str().unwrap_or("data")
                )
            });
        params.insert(
            key,
            json!({
                "metadata": metadata_for(kind),
                "item_indices": [position],
                "peer_host": "127.0.0.1",
                "peer_port": 7000 + position,
                "size_bytes": 4096,
                "encoder": name,
            }),
        );
    }
    Value::Object(params)
}

/// Counts a sub-request as cancelled if dropped before it was answered.
struct CancelGuard(Arc<Shared>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        self.0.cancelled_notify.notify_waiters();
    }
}

fn status_answer(code: u16, text: &'static str) -> Response {
    (
        StatusCode::from_u16(code).unwrap(),
        [(header::CONTENT_TYPE, "application/json")],
        text,
    )
        .into_response()
}

/// Never returns; the sub-request counts as cancelled once the gateway drops it.
async fn hold(shared: &Arc<Shared>, signal: &Notify) -> ! {
    let _guard = CancelGuard(shared.clone());
    signal.notify_one();
    std::future::pending::<()>().await;
    unreachable!()
}

async fn encode(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    shared.requests.lock().unwrap().push(Recorded {
        headers: headers.clone(),
        body: body.clone(),
    });
    let behavior = shared.behavior.lock().unwrap().clone();
    let params = match behavior {
        Behavior::Normal => Some(normal_params(&shared.name, &body)),
        Behavior::Silent => None,
        Behavior::Custom(reply) => Some(reply(&body)),
        Behavior::Status(code, text) => return status_answer(code, text),
        Behavior::StatusAfter(code, text, signal) => {
            signal.notified().await;
            return status_answer(code, text);
        }
        Behavior::HoldSignalling(signal) => hold(&shared, &signal).await,
    };
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    let mut answer = json!({
        "id": format!("chatcmpl-{request_id}"),
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                     "logprobs": null, "finish_reason": "length", "stop_reason": null}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40},
    });
    if let Some(params) = params {
        answer["ec_transfer_params"] = params;
    }
    Json(answer).into_response()
}
