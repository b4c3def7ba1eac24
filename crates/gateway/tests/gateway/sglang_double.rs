//! Test doubles of SGLang prefill and decode workers in a bootstrap P/D deployment.
//!
//! Both get the same body with `bootstrap_host`/`bootstrap_port`/`bootstrap_room`. As
//! in SGLang, a decode worker produces nothing until the prefill worker has sent the
//! KV of each of its rooms (modelled by a [`Link`] the doubles of a test share), so a
//! prefill worker that fails before sending its KV leaves the decode worker waiting.
//! Each double records its requests and counts requests the gateway dropped (its side
//! of the connection closed) before they finished.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::Notify;

/// What the doubles of one test share: the rooms whose KV a prefill worker sent, and
/// whether a decode worker has sent its first byte.
#[derive(Default)]
pub struct Link {
    rooms: Mutex<HashSet<u64>>,
    rooms_changed: Notify,
    decode_started: AtomicBool,
    decode_started_notify: Notify,
    released: AtomicBool,
    release_notify: Notify,
}

impl Link {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn send_kv(&self, rooms: &[u64]) {
        self.rooms.lock().unwrap().extend(rooms);
        self.rooms_changed.notify_waiters();
    }

    /// Waits until every room's KV arrived.
    async fn receive_kv(&self, rooms: &[u64]) {
        loop {
            let changed = self.rooms_changed.notified();
            if rooms.iter().all(|r| self.rooms.lock().unwrap().contains(r)) {
                return;
            }
            changed.await;
        }
    }

    fn decode_started(&self) {
        self.decode_started.store(true, Ordering::SeqCst);
        self.decode_started_notify.notify_waiters();
    }

    /// Lets a `Gated` prefill double answer.
    pub fn release_prefill(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.release_notify.notify_waiters();
    }

    async fn wait_released(&self) {
        loop {
            let notified = self.release_notify.notified();
            if self.released.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }

    async fn wait_decode_started(&self) {
        loop {
            let notified = self.decode_started_notify.notified();
            if self.decode_started.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

/// How a prefill double answers.
#[derive(Debug, Clone, Copy)]
pub enum Prefill {
    /// Sends the KV, then answers like SGLang.
    Normal,
    /// This status (no KV sent).
    Status(u16),
    /// 200 with a body that is neither JSON nor SSE (no KV sent).
    Garbage,
    /// Never answers (no KV sent).
    Hang,
    /// Sends a 200 head, then breaks the connection (no KV sent).
    Close,
    /// Sends the KV, waits for the decode worker's first byte, then fails as given.
    AfterDecode(Late),
    /// Sends the KV, then answers normally once the test calls `release_prefill`.
    Gated,
    /// Like a pdserve prefill worker asked for a stream: streams its one token at once
    /// (chunk-shaped), sends the KV, and ends its stream once the decode worker started,
    /// cleanly or (`then_break`) by breaking the connection.
    StreamsToken { then_break: bool },
}

/// How a prefill double fails after the decode worker started streaming.
#[derive(Debug, Clone, Copy)]
pub enum Late {
    Status(u16),
    Garbage,
    Hang,
    Close,
}

/// How a decode double answers.
#[derive(Debug, Clone, Copy)]
pub enum Decode {
    /// Waits for its rooms' KV, then generates `max_tokens` tokens (default 3).
    Normal,
    /// Answers this status at once.
    Status(u16),
    /// Waits for the KV, streams two events, then breaks the connection.
    FailMidStream,
    /// Waits for the KV, then streams a token every 20 ms forever.
    Endless,
    /// Waits for the KV and for the test's `release_prefill`, then answers as `Normal`.
    GatedHead,
}

#[derive(Debug, Clone, Copy)]
enum Behavior {
    Prefill(Prefill),
    Decode(Decode),
}

struct Shared {
    link: Arc<Link>,
    behavior: Mutex<Behavior>,
    requests: Mutex<Vec<(String, Value)>>,
    raw_bodies: Mutex<Vec<Bytes>>,
    cancelled: AtomicUsize,
    cancelled_notify: Notify,
}

/// Counts a request as cancelled if dropped before it finished.
struct CancelGuard {
    shared: Arc<Shared>,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shared.cancelled.fetch_add(1, Ordering::SeqCst);
            self.shared.cancelled_notify.notify_waiters();
        }
    }
}

/// A running SGLang double on 127.0.0.1.
pub struct SglangDouble {
    pub url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SglangDouble {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SglangDouble {
    pub async fn prefill(link: &Arc<Link>, behavior: Prefill) -> Self {
        Self::start(link, Behavior::Prefill(behavior)).await
    }

    pub async fn decode(link: &Arc<Link>, behavior: Decode) -> Self {
        Self::start(link, Behavior::Decode(behavior)).await
    }

    async fn start(link: &Arc<Link>, behavior: Behavior) -> Self {
        let shared = Arc::new(Shared {
            link: link.clone(),
            behavior: Mutex::new(behavior),
            requests: Mutex::new(Vec::new()),
            raw_bodies: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
            cancelled_notify: Notify::new(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(generate))
            .route("/v1/completions", post(generate))
            .route("/generate", post(generate))
            .route("/health", get(|| async { StatusCode::OK }))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, shared, task }
    }

    /// Every request body received so far, with its path.
    pub fn requests(&self) -> Vec<(String, Value)> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Every request body received so far, as the bytes that arrived.
    pub fn raw_bodies(&self) -> Vec<Bytes> {
        self.shared.raw_bodies.lock().unwrap().clone()
    }

    /// The only request body received so far.
    pub fn only_body(&self) -> Value {
        let requests = self.requests();
        assert_eq!(requests.len(), 1, "{requests:?}");
        requests[0].1.clone()
    }

    /// Requests dropped by the gateway before they finished.
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    /// Waits until the gateway dropped a request (closed its connection).
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

/// The request's rooms (one, or one per item).
pub fn rooms(body: &Value) -> Vec<u64> {
    match &body["bootstrap_room"] {
        Value::Array(items) => items.iter().map(|r| r.as_u64().unwrap()).collect(),
        room => vec![room.as_u64().expect("bootstrap_room")],
    }
}

async fn generate(State(shared): State<Arc<Shared>>, uri: Uri, raw: Bytes) -> Response {
    let path = uri.path().to_string();
    let body: Value = serde_json::from_slice(&raw).expect("a JSON body");
    shared
        .requests
        .lock()
        .unwrap()
        .push((path.clone(), body.clone()));
    shared.raw_bodies.lock().unwrap().push(raw);
    let behavior = *shared.behavior.lock().unwrap();
    let format = Format::of(&path, &body);
    let mut guard = CancelGuard {
        shared: shared.clone(),
        armed: true,
    };
    let rooms = rooms(&body);
    match behavior {
        Behavior::Prefill(p) => {
            let late = match p {
                Prefill::Normal => None,
                Prefill::Gated => {
                    shared.link.send_kv(&rooms);
                    shared.link.wait_released().await;
                    guard.armed = false;
                    return format.answer(1, true);
                }
                Prefill::AfterDecode(late) => Some(late),
                Prefill::StreamsToken { then_break } => {
                    guard.armed = false;
                    return streamed_token(&shared, &format, rooms, then_break);
                }
                Prefill::Status(code) => {
                    guard.armed = false;
                    return status(code);
                }
                Prefill::Garbage => {
                    guard.armed = false;
                    return garbage();
                }
                Prefill::Hang => std::future::pending().await,
                Prefill::Close => {
                    guard.armed = false;
                    return broken();
                }
            };
            shared.link.send_kv(&rooms);
            if let Some(late) = late {
                shared.link.wait_decode_started().await;
                guard.armed = false;
                return match late {
                    Late::Status(code) => status(code),
                    Late::Garbage => garbage(),
                    Late::Close => broken(),
                    Late::Hang => {
                        guard.armed = true;
                        std::future::pending().await
                    }
                };
            }
            guard.armed = false;
            format.answer(1, true)
        }
        Behavior::Decode(Decode::Status(code)) => {
            guard.armed = false;
            status(code)
        }
        Behavior::Decode(d) => {
            shared.link.receive_kv(&rooms).await;
            if matches!(d, Decode::GatedHead) {
                shared.link.wait_released().await;
            }
            let tokens = body["max_tokens"]
                .as_u64()
                .or(body["sampling_params"]["max_new_tokens"].as_u64())
                .unwrap_or(3) as usize;
            if !format.stream {
                guard.armed = false;
                return format.answer(tokens, false);
            }
            let link = shared.link.clone();
            let events = futures::stream::unfold(
                (0usize, Some(guard), format, d),
                move |(i, guard, format, d)| {
                    let link = link.clone();
                    async move {
                        let mut guard = guard?;
                        if i > 0 {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        let endless = matches!(d, Decode::Endless);
                        if matches!(d, Decode::FailMidStream) && i == 2 {
                            guard.armed = false;
                            return Some((
                                Err(std::io::Error::other("engine died")),
                                (i, None, format, d),
                            ));
                        }
                        if i == tokens && !endless {
                            guard.armed = false;
                            let done = Bytes::from_static(b"data: [DONE]\n\n");
                            return Some((Ok(done), (i + 1, None, format, d)));
                        }
                        let last = i + 1 == tokens && !endless;
                        let event = format.event(i, last);
                        if i == 0 {
                            link.decode_started();
                        }
                        Some((Ok(event), (i + 1, Some(guard), format, d)))
                    }
                },
            );
            sse(Body::from_stream(events))
        }
    }
}

/// A prefill stream whose token event goes out at once; the KV is sent after it and
/// the stream ends once the decode worker sent its first byte.
fn streamed_token(
    shared: &Arc<Shared>,
    format: &Format,
    rooms: Vec<u64>,
    then_break: bool,
) -> Response {
    let event = match format.route {
        Route::Chat => json!({"id": "p", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0,
            "delta": {"role": "assistant", "content": "tok0"}, "logprobs": null,
            "finish_reason": null}]}),
        _ => json!({"id": "p", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "tok0", "logprobs": null,
            "finish_reason": null}]}),
    };
    let first = Bytes::from(format!("data: {event}\n\n"));
    let link = shared.link.clone();
    let rest = async move {
        link.send_kv(&rooms);
        link.wait_decode_started().await;
        if then_break {
            Err(std::io::Error::other("prefill died"))
        } else {
            Ok(Bytes::from_static(b"data: [DONE]\n\n"))
        }
    };
    let body = futures::stream::once(async move { Ok::<_, std::io::Error>(first) })
        .chain(futures::stream::once(rest));
    sse(Body::from_stream(body))
}

fn status(code: u16) -> Response {
    let body = json!({"error": {"message": format!("double says {code}"), "type": "x",
                                "param": null, "code": code}});
    (StatusCode::from_u16(code).unwrap(), Json(body)).into_response()
}

fn garbage() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        "<html>502 proxy error",
    )
        .into_response()
}

/// A 200 head, then the connection breaks.
fn broken() -> Response {
    let body = futures::stream::once(async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Err::<Bytes, _>(std::io::Error::other("prefill died"))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

fn sse(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

/// Which wire format a request wants.
#[derive(Debug, Clone, Copy)]
struct Format {
    route: Route,
    stream: bool,
    /// Choices (chat `n`) or items (a /generate text batch).
    items: usize,
    logprobs: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Route {
    Chat,
    Completions,
    Generate,
}

impl Format {
    fn of(path: &str, body: &Value) -> Self {
        let route = match path {
            "/v1/chat/completions" => Route::Chat,
            "/v1/completions" => Route::Completions,
            _ => Route::Generate,
        };
        let items = match route {
            Route::Generate => body["text"].as_array().map_or(1, Vec::len),
            _ => body["n"].as_u64().unwrap_or(1) as usize,
        };
        Self {
            route,
            stream: body["stream"].as_bool() == Some(true),
            items,
            logprobs: body["return_logprob"].as_bool() == Some(true)
                || (body["echo"].as_bool() == Some(true) && !body["logprobs"].is_null()),
        }
    }

    /// The non-stream answer (`tokens` tokens per item). A prefill worker computes the
    /// prompt's logprobs; a decode worker echoes the prompt without them.
    fn answer(&self, tokens: usize, prefill: bool) -> Response {
        let text: String = (0..tokens).map(|i| format!("tok{i}")).collect();
        if self.route == Route::Generate {
            let items: Vec<Value> = (0..self.items)
                .map(|i| {
                    let mut meta = json!({"id": format!("r{i}"), "prompt_tokens": 2,
                        "completion_tokens": tokens,
                        "finish_reason": {"type": "length", "length": tokens}});
                    if self.logprobs {
                        meta["input_token_logprobs"] = if prefill {
                            json!([[null, 1, null], [-0.5, 2, null]])
                        } else {
                            json!([])
                        };
                    }
                    json!({"text": text, "meta_info": meta, "index": i})
                })
                .collect();
            let body = if self.items > 1 {
                Value::Array(items)
            } else {
                items.into_iter().next().unwrap()
            };
            return Json(body).into_response();
        }
        let choices: Vec<Value> = (0..self.items)
            .map(|i| {
                if self.route == Route::Chat {
                    json!({"index": i, "message": {"role": "assistant", "content": text},
                           "logprobs": null, "finish_reason": "length"})
                } else {
                    let logprobs = self.logprobs.then(|| {
                        let prompt_logprob = if prefill { json!(-0.5) } else { Value::Null };
                        json!({"tokens": ["a", " b", "tok0"], "text_offset": [0, 1, 3],
                               "token_logprobs": [null, prompt_logprob, -0.1],
                               "top_logprobs": [null, null, null]})
                    });
                    json!({"index": i, "text": text, "logprobs": logprobs,
                           "finish_reason": "length"})
                }
            })
            .collect();
        let object = if self.route == Route::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let body = json!({"id": "x", "object": object, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 2, "completion_tokens": tokens,
                      "total_tokens": 2 + tokens}});
        if self.stream && prefill {
            // SGLang's prefill worker streams when asked to.
            return sse(Body::from(format!("data: {body}\n\ndata: [DONE]\n\n")));
        }
        Json(body).into_response()
    }

    /// Stream event `i` (one per item).
    fn event(&self, i: usize, last: bool) -> Bytes {
        let finish = last.then_some("length");
        let mut out = String::new();
        for item in 0..self.items {
            let event = match self.route {
                Route::Generate => {
                    let mut meta = json!({"id": format!("r{item}"), "completion_tokens": i + 1,
                        "finish_reason": finish.map(|f| json!({"type": f}))});
                    if self.logprobs {
                        meta["input_token_logprobs"] = json!([]);
                    }
                    json!({"text": format!("tok{i}"), "meta_info": meta, "index": item})
                }
                Route::Chat => json!({"id": "x", "object": "chat.completion.chunk",
                    "choices": [{"index": item, "delta": {"content": format!("tok{i}")},
                                 "finish_reason": finish}]}),
                Route::Completions => json!({"id": "x", "object": "text_completion",
                    "choices": [{"index": item, "text": format!("tok{i}"),
                                 "finish_reason": finish}]}),
            };
            out.push_str(&format!("data: {event}\n\n"));
        }
        Bytes::from(out)
    }
}
