//! A test double of a vLLM worker (prefill or decode role of a NIXL P/D deployment) that
//! speaks vLLM's OpenAI wire format, records every request, and fails on demand.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::Notify;

/// What the double is in a P/D deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Answers a one-token non-stream completion with its KV handle.
    Prefill,
    /// Generates (streamed or not); the last chunk carries its own KV handle.
    Decode,
}

/// How the double answers the next requests.
#[derive(Debug, Clone)]
pub enum Behavior {
    /// Like vLLM.
    Normal,
    /// This status with this body.
    Status(u16, &'static str),
    /// 200 with a body that is neither JSON nor SSE.
    Garbage,
    /// 200 with an empty event stream.
    EmptyStream,
    /// Wait, then answer normally (cancellation during the wait is recorded).
    Delay(Duration),
    /// Stream two events, then break the connection.
    FailMidStream,
    /// Never finish: a non-stream request waits forever, a stream sends a token every
    /// 20 ms forever. Recorded as cancelled when the gateway drops it.
    Hold,
    /// Stream the first token, then wait for `release()` before the rest.
    Gated,
    /// This status with this body for the next `n` requests, then `Normal`.
    StatusTimes(u16, &'static str, usize),
    /// Stream like `Normal`, but with this text as the first token (a decode worker that
    /// does not continue from the prefill leg's token).
    FirstToken(&'static str),
}

/// One request as the double received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The gateway's side of the TCP connection the request came on.
    pub peer: std::net::SocketAddr,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

struct Shared {
    role: Role,
    healthy: std::sync::atomic::AtomicBool,
    draining: std::sync::atomic::AtomicBool,
    name: String,
    behavior: Mutex<Behavior>,
    requests: Mutex<Vec<Recorded>>,
    cancelled: AtomicUsize,
    cancelled_notify: Notify,
    gate: Notify,
    profiling: std::sync::atomic::AtomicBool,
    /// `(waiting, running)` the double's `/metrics` reports; `None`: 404.
    queue: Mutex<Option<(f64, f64)>>,
}

/// Counts a request as cancelled if dropped before it finished.
struct CancelGuard {
    shared: Arc<Shared>,
    armed: bool,
}

impl CancelGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        Self {
            shared: shared.clone(),
            armed: true,
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shared.cancelled.fetch_add(1, Ordering::SeqCst);
            self.shared.cancelled_notify.notify_waiters();
        }
    }
}

/// A running double on 127.0.0.1, on a runtime of its own so that `kill` can close
/// every socket at once, as a dying process would.
pub struct Double {
    pub url: String,
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Double {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Double {
    /// Starts a double with `role`, named `name` (used in its KV handles).
    pub async fn start(role: Role, name: &str) -> Self {
        let shared = Arc::new(Shared {
            role,
            healthy: std::sync::atomic::AtomicBool::new(true),
            draining: std::sync::atomic::AtomicBool::new(false),
            name: name.to_string(),
            behavior: Mutex::new(Behavior::Normal),
            requests: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
            cancelled_notify: Notify::new(),
            gate: Notify::new(),
            profiling: std::sync::atomic::AtomicBool::new(false),
            queue: Mutex::new(None),
        });
        let (runtime, addr) = serve(&shared, "127.0.0.1:0".parse().unwrap());
        Self {
            url: format!("http://{addr}"),
            addr,
            shared,
            runtime: Some(runtime),
        }
    }

    /// Stops the double as a crash would: listener and every open connection closed.
    pub fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// Starts the double again on the same port (after `kill`).
    pub fn restart(&mut self) {
        assert!(self.runtime.is_none(), "kill the double first");
        let (runtime, _) = serve(&self.shared, self.addr);
        self.runtime = Some(runtime);
    }

    /// Whether `GET /health` answers 503 with a pdserve worker's draining body.
    pub fn set_draining(&self, draining: bool) {
        self.shared.draining.store(draining, Ordering::SeqCst);
    }

    /// Whether `GET /health` answers 200 (else 503).
    pub fn set_healthy(&self, healthy: bool) {
        self.shared.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Whether `/start_profile` and `/stop_profile` answer 200 (else 404, as vLLM
    /// without a profiler directory).
    pub fn set_profiling(&self, on: bool) {
        self.shared.profiling.store(on, Ordering::SeqCst);
    }

    /// Sets how the next requests are answered.
    pub fn set(&self, behavior: Behavior) {
        *self.shared.behavior.lock().unwrap() = behavior;
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The only request received so far.
    pub fn only_request(&self) -> Recorded {
        let requests = self.requests();
        assert_eq!(requests.len(), 1, "{} got {:?}", self.shared.name, requests);
        requests.into_iter().next().unwrap()
    }

    /// Waits until `n` requests have arrived.
    pub async fn wait_for_requests(&self, n: usize) {
        while self.shared.requests.lock().unwrap().len() < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Requests dropped by the gateway before they finished.
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    /// Waits until a request has been dropped by the gateway.
    pub async fn wait_for_cancel(&self) {
        loop {
            let notified = self.shared.cancelled_notify.notified();
            if self.cancelled() > 0 {
                return;
            }
            notified.await;
        }
    }

    /// Makes `/metrics` report `waiting` and `running` requests (vLLM's gauges); `None`
    /// answers 404.
    pub fn report_queue(&self, queue: Option<(f64, f64)>) {
        *self.shared.queue.lock().unwrap() = queue;
    }

    /// Lets a `Gated` stream finish.
    pub fn release(&self) {
        self.shared.gate.notify_one();
    }

    /// The KV handle this double returns for `request_id` (what vLLM's NIXL connector
    /// puts in `kv_transfer_params` when a request finishes).
    pub fn kv_handle(&self, request_id: &str) -> Value {
        kv_handle(&self.shared, request_id)
    }
}

/// Serves the double's routes on `addr` (port 0: any) on a new single-thread runtime.
fn serve(
    shared: &Arc<Shared>,
    addr: std::net::SocketAddr,
) -> (tokio::runtime::Runtime, std::net::SocketAddr) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/v1/chat/completions", post(generate))
        .route("/v1/completions", post(generate))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/start_profile", post(profile))
        .route("/stop_profile", post(profile))
        .with_state(shared.clone());
    let listener = {
        let _context = runtime.enter();
        // SO_REUSEADDR: a restarted double rebinds its port while old connections linger.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.bind(addr).unwrap();
        socket.listen(1024).unwrap()
    };
    let bound = listener.local_addr().unwrap();
    runtime.spawn(async move {
        let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, app).await.unwrap();
    });
    (runtime, bound)
}

/// vLLM's queue gauges, as `report_queue` set them.
async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    match *shared.queue.lock().unwrap() {
        Some((waiting, running)) => format!(
            "# TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"double\"}} {running}\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"double\"}} {waiting}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"double\"}} 0.5\n"
        )
        .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if shared.draining.load(Ordering::SeqCst) {
        let body = r#"{"status":"unavailable","reason":"draining","message":"shutting down"}"#;
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    } else if shared.healthy.load(Ordering::SeqCst) {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

async fn profile(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    shared.requests.lock().unwrap().push(Recorded {
        peer,
        path: uri.path().to_string(),
        headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    if shared.profiling.load(Ordering::SeqCst) {
        // vLLM answers an empty 200.
        StatusCode::OK.into_response()
    } else {
        (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
    }
}

fn kv_handle(shared: &Shared, request_id: &str) -> Value {
    let (blocks, port) = match shared.role {
        Role::Prefill => (json!([1, 2, 3]), 5600),
        Role::Decode => (json!([[7, 8]]), 5601),
    };
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks,
        "remote_engine_id": format!("engine-{}", shared.name),
        "remote_request_id": format!("{}-{request_id}", shared.name),
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1
    })
}

async fn models() -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "vllm",
                  "root": "m", "parent": null, "max_model_len": 2048, "permission": []}]
    }))
}

async fn generate(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    shared.requests.lock().unwrap().push(Recorded {
        peer,
        path: uri.path().to_string(),
        headers: headers.clone(),
        body: body.clone(),
    });
    let behavior = {
        let mut current = shared.behavior.lock().unwrap();
        match &mut *current {
            Behavior::StatusTimes(code, text, n) => {
                let once = Behavior::Status(*code, text);
                *n -= 1;
                if *n == 0 {
                    *current = Behavior::Normal;
                }
                once
            }
            other => other.clone(),
        }
    };
    let chat = uri.path().ends_with("/chat/completions");
    let stream = body["stream"].as_bool() == Some(true);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_string();
    let tokens = body["max_tokens"]
        .as_u64()
        .or(body["max_completion_tokens"].as_u64())
        .unwrap_or(3)
        .clamp(1, 16) as usize;
    let answer = Answer {
        shared: shared.clone(),
        chat,
        request_id,
        tokens,
    };
    match behavior {
        Behavior::Normal => answer.normal(stream, false).await,
        Behavior::FirstToken(first) => answer.normal_from(stream, false, first).await,
        Behavior::Gated => answer.normal(stream, true).await,
        Behavior::StatusTimes(..) => unreachable!("taken above"),
        Behavior::Status(code, text) => (
            StatusCode::from_u16(code).unwrap(),
            [(header::CONTENT_TYPE, "application/json")],
            text,
        )
            .into_response(),
        Behavior::Garbage => (
            [(
                header::CONTENT_TYPE,
                if stream {
                    "text/event-stream"
                } else {
                    "application/json"
                },
            )],
            "<html>502 proxy error",
        )
            .into_response(),
        Behavior::EmptyStream => {
            ([(header::CONTENT_TYPE, "text/event-stream")], "").into_response()
        }
        Behavior::Delay(d) => {
            let mut guard = CancelGuard::new(&shared);
            tokio::time::sleep(d).await;
            guard.armed = false;
            answer.normal(stream, false).await
        }
        Behavior::FailMidStream => {
            let events: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(answer.event(Some("assistant"), "", None, false)),
                Ok(answer.event(None, "tok0", None, false)),
            ];
            // Let the first events leave before the connection breaks.
            let failure = futures::stream::once(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(std::io::Error::other("engine died"))
            });
            let events = futures::StreamExt::chain(futures::stream::iter(events), failure);
            sse(Body::from_stream(events))
        }
        Behavior::Hold => {
            let guard = CancelGuard::new(&shared);
            if !stream {
                let _guard = guard;
                std::future::pending::<()>().await;
                unreachable!()
            }
            let first = answer.event(Some("assistant"), "", None, false);
            // The first token is the prefill answer's ("tok0"), as a real decode worker's.
            let ticks =
                futures::stream::unfold((answer, guard, 0usize), |(answer, guard, i)| async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let chunk =
                        answer.event(None, if i == 0 { "tok0" } else { "tok" }, None, false);
                    Some((Ok::<_, Infallible>(chunk), (answer, guard, i + 1)))
                });
            let body = futures::stream::once(async move { Ok::<_, Infallible>(first) });
            sse(Body::from_stream(futures::StreamExt::chain(body, ticks)))
        }
    }
}

fn sse(body: Body) -> Response {
    (
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        body,
    )
        .into_response()
}

/// Builds vLLM-shaped responses for one request.
struct Answer {
    shared: Arc<Shared>,
    chat: bool,
    request_id: String,
    tokens: usize,
}

impl Answer {
    fn id(&self) -> String {
        let prefix = if self.chat { "chatcmpl" } else { "cmpl" };
        format!("{prefix}-{}", self.request_id)
    }

    /// One `data:` event of a stream.
    fn event(&self, role: Option<&str>, text: &str, finish: Option<&str>, kv: bool) -> Bytes {
        let choice = if self.chat {
            let mut delta = json!({"content": text});
            if let Some(role) = role {
                delta["role"] = json!(role);
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish,
                   "stop_reason": null})
        };
        let mut chunk = json!({
            "id": self.id(),
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": 1_700_000_000,
            "model": "m",
            "choices": [choice],
        });
        if kv {
            chunk["kv_transfer_params"] = kv_handle(&self.shared, &self.request_id);
        }
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// The non-stream body (`chat.completion` / `text_completion`) with the KV handle.
    fn full(&self, tokens: usize) -> Value {
        let text: String = (0..tokens).map(|i| format!("tok{i}")).collect();
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "reasoning_content": null,
                   "content": text, "tool_calls": []},
                   "logprobs": null, "finish_reason": "length", "stop_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                   "stop_reason": null, "prompt_logprobs": null})
        };
        json!({
            "id": self.id(),
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": 1_700_000_000,
            "model": "m",
            "choices": [choice],
            "usage": {"prompt_tokens": 5, "total_tokens": 5 + tokens,
                      "completion_tokens": tokens, "prompt_tokens_details": null},
            "prompt_logprobs": null,
            "kv_transfer_params": kv_handle(&self.shared, &self.request_id),
        })
    }

    async fn normal(self, stream: bool, gated: bool) -> Response {
        self.normal_from(stream, gated, "tok0").await
    }

    /// As `normal`, with `first` as the stream's first token.
    async fn normal_from(self, stream: bool, gated: bool, first: &'static str) -> Response {
        if !stream || self.shared.role == Role::Prefill {
            let tokens = if self.shared.role == Role::Prefill {
                1
            } else {
                self.tokens
            };
            return Json(self.full(tokens)).into_response();
        }
        let answer = Arc::new(self);
        let a = answer.clone();
        let body = async_events(move |tx| async move {
            tx.send(a.event(Some("assistant"), "", None, false))
                .await
                .ok();
            for i in 0..a.tokens {
                if gated && i == 1 {
                    a.shared.gate.notified().await;
                }
                let last = i + 1 == a.tokens;
                let finish = last.then_some("length");
                let text = if i == 0 {
                    first.to_string()
                } else {
                    format!("tok{i}")
                };
                tx.send(a.event(None, &text, finish, last)).await.ok();
            }
            tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.ok();
        });
        sse(body)
    }
}

/// A body fed by a task through a channel (the task ends if the body is dropped).
fn async_events<F, Fut>(produce: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(produce(tx));
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Body::from_stream(stream)
}
