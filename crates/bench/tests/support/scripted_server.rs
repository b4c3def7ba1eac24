//! An OpenAI-compatible server whose answers follow a script: known delays before the
//! first token and between tokens, scripted HTTP errors and broken streams, so the
//! benchmark's measurements can be checked against the truth. Used by the tests and by
//! `cargo run --example scripted_server`.
//!
//! Wire format as vLLM streams it: chat streams open with a role-only chunk sent at
//! once (it must not count as the first token), every content chunk carries one token,
//! then a `usage` chunk (`choices: []`) and `data: [DONE]`. `usage.prompt_tokens` is
//! the prompt's word count; `cached_tokens` is the word count of every chat message but
//! the last (what a perfect prefix cache would hold). A server started with
//! [`ScriptedServer::start_prefix_cached`] reports for a completion prompt the longest
//! word prefix it shares with any earlier prompt instead (an unbounded prefix cache).
//!
//! `POST /v1/responses` speaks OpenAI's Responses API: ids `resp_1`, `resp_2`, ... in
//! arrival order; stored responses hold their conversation's word count, so a turn
//! naming `previous_response_id` reports `input_tokens` = instructions + the stored
//! conversation + the new input, all but the new input cached (an unknown id is a 404).
//! Streams send the Responses events (`event:` and `data:` with `type`), ending with
//! `response.incomplete` when `ignore_eos` is set (the length limit was hit), else
//! `response.completed`; a scripted error event is an `error` event.

#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use pdserve_protocol::{sse, ApiError};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The model the server lists.
pub const MODEL: &str = "scripted-model";

/// How the server answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Stream `max_tokens` tokens: the first after `ttft`, the rest `itl` apart.
    Stream { ttft: Duration, itl: Duration },
    /// Answer this HTTP status with an OpenAI error body.
    Error { status: u16, message: String },
    /// Stream this many tokens, then close the stream without `[DONE]`.
    Truncated { after: usize },
    /// Stream this many tokens, then an in-stream error event (as the pdserve gateway
    /// and vLLM send when generation fails mid-stream) and `[DONE]`.
    ErrorEvent { after: usize, message: String },
    /// Ignore `stream: true` and answer one JSON completion.
    Json,
}

impl Reply {
    /// A stream with delays in milliseconds.
    pub fn stream_ms(ttft: u64, itl: u64) -> Self {
        Self::Stream {
            ttft: Duration::from_millis(ttft),
            itl: Duration::from_millis(itl),
        }
    }
}

/// The reply to the `n`th scripted request, which may depend on its body.
type Script = Arc<dyn Fn(usize, &Value) -> Reply + Send + Sync>;

struct AppState {
    script: Script,
    scripted: AtomicUsize,
    requests: Mutex<Vec<Value>>,
    /// Responses issued so far (the last id's number).
    responses: AtomicUsize,
    /// Stored responses: id → words of the conversation up to and including it.
    stored: Mutex<HashMap<String, u64>>,
    /// Completion prompts seen so far, as words, when acting as a prefix cache.
    prefix_cache: Option<Mutex<Vec<Vec<String>>>>,
}

impl AppState {
    fn new(script: Script) -> Arc<Self> {
        Arc::new(Self {
            script,
            scripted: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            responses: AtomicUsize::new(0),
            stored: Mutex::new(HashMap::new()),
            prefix_cache: None,
        })
    }
}

/// A running scripted server on 127.0.0.1 (random port).
pub struct ScriptedServer {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<AppState>,
    task: JoinHandle<()>,
}

impl ScriptedServer {
    /// Starts a server answering the `n`th request that asks for more than one token
    /// with `script(n)` (requests for one token, i.e. the benchmark's probe, get an
    /// immediate answer and do not advance the script).
    pub async fn start(script: impl Fn(usize) -> Reply + Send + Sync + 'static) -> Self {
        Self::start_on(
            TcpListener::bind("127.0.0.1:0").await.expect("bind"),
            script,
        )
        .await
    }

    /// Like [`ScriptedServer::start`], with a script that also sees the request body
    /// (e.g. to reject by `priority`, as an overloaded gateway's queue does).
    pub async fn start_with_body(
        script: impl Fn(usize, &Value) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::serve(listener, Arc::new(script)).await
    }

    /// Like [`ScriptedServer::start`], reporting for each completion prompt as cached the
    /// longest word prefix it shares with an earlier prompt (the probe's included).
    pub async fn start_prefix_cached(
        script: impl Fn(usize) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut state = AppState::new(Arc::new(move |n, _: &Value| script(n)));
        Arc::get_mut(&mut state)
            .expect("not shared yet")
            .prefix_cache = Some(Mutex::new(Vec::new()));
        Self::serve_state(listener, state).await
    }

    /// Like [`ScriptedServer::start`], on a listener the caller bound.
    pub async fn start_on(
        listener: TcpListener,
        script: impl Fn(usize) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::serve(listener, Arc::new(move |n, _: &Value| script(n))).await
    }

    async fn serve(listener: TcpListener, script: Script) -> Self {
        Self::serve_state(listener, AppState::new(script)).await
    }

    async fn serve_state(listener: TcpListener, state: Arc<AppState>) -> Self {
        let app = Router::new()
            .route("/v1/models", get(models))
            .route("/v1/completions", post(generate))
            .route("/v1/chat/completions", post(generate))
            .route("/v1/responses", post(respond))
            .with_state(state.clone());
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, state, task }
    }

    /// A server that answers every request with an HTML page and `status` (not OpenAI).
    pub async fn start_html(status: StatusCode) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let app = Router::new().fallback(move || async move {
            (
                status,
                [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
                "<!doctype html><html><body>Welcome to nginx!</body></html>",
            )
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let state = AppState::new(Arc::new(|_, _: &Value| Reply::stream_ms(0, 0)));
        Self { addr, state, task }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every generation request body received, in arrival order.
    pub fn requests(&self) -> Vec<Value> {
        self.state.requests.lock().expect("lock").clone()
    }

    /// Stops serving (in-flight streams are cut).
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn models() -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}]
    }))
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// Prompt and cached word counts of a request, and whether it is a chat request.
fn prompt_counts(body: &Value) -> (u64, u64, bool) {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let counts: Vec<u64> = messages
            .iter()
            .map(|m| words(m["content"].as_str().unwrap_or("")))
            .collect();
        let total = counts.iter().sum::<u64>();
        (total, total - counts.last().copied().unwrap_or(0), true)
    } else {
        (words(body["prompt"].as_str().unwrap_or("")), 0, false)
    }
}

fn chunk(chat: bool, text: &str) -> Bytes {
    let value = if chat {
        json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
    } else {
        json!({"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "text": text, "finish_reason": null}]})
    };
    sse::data_event(&value)
}

async fn generate(State(state): State<Arc<AppState>>, Json(body): Json<Value>) -> Response {
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    state.requests.lock().expect("lock").push(body.clone());
    let reply = if max_tokens > 1 {
        (state.script)(state.scripted.fetch_add(1, Ordering::SeqCst), &body)
    } else {
        Reply::stream_ms(0, 0)
    };
    let (prompt, mut cached, chat) = prompt_counts(&body);
    if let (Some(cache), Some(text)) = (&state.prefix_cache, body["prompt"].as_str()) {
        let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
        let mut seen = cache.lock().expect("lock");
        cached = seen
            .iter()
            .map(|s| s.iter().zip(&words).take_while(|(a, b)| a == b).count() as u64)
            .max()
            .unwrap_or(0);
        seen.push(words);
    }
    let (ttft, itl, tokens, finish) = match reply {
        Reply::Error { status, message } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return ApiError::new(status, "scripted", message).into_response();
        }
        Reply::Stream { ttft, itl } => (ttft, itl, max_tokens, true),
        Reply::Truncated { after } => (Duration::ZERO, Duration::ZERO, after, false),
        Reply::ErrorEvent { after, message } => {
            let mut events: Vec<Bytes> = (0..after)
                .map(|i| chunk(chat, &format!(" tok{i}")))
                .collect();
            let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "scripted", message);
            events.push(sse::data_event(&error.to_json()));
            events.push(Bytes::from_static(sse::DONE));
            let stream = futures::stream::iter(events.into_iter().map(Ok::<Bytes, Infallible>));
            return Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(stream))
                .expect("static response parts");
        }
        Reply::Json => {
            return Json(
                json!({"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": " tok0", "finish_reason": "length"}]}),
            )
            .into_response();
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        if chat {
            let role = json!({"id": "c", "object": "chat.completion.chunk", "created": 0,
                "model": MODEL, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
            if tx.send(sse::data_event(&role)).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(ttft).await;
        for i in 0..tokens {
            if i > 0 {
                tokio::time::sleep(itl).await;
            }
            if tx.send(chunk(chat, &format!(" tok{i}"))).await.is_err() {
                return;
            }
        }
        if !finish {
            return;
        }
        let usage = json!({"id": "c", "object": "chunk", "created": 0, "model": MODEL, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                      "total_tokens": prompt + tokens as u64,
                      "prompt_tokens_details": {"cached_tokens": cached}}});
        let _ = tx.send(sse::data_event(&usage)).await;
        let _ = tx.send(Bytes::from_static(sse::DONE)).await;
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts")
}

/// One Responses stream event: `event:` its type, `data:` the object with `type`.
fn response_event(kind: &str, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The words of a Responses `input`: a string, or message items with string content.
fn input_words(input: &Value) -> u64 {
    match input {
        Value::String(text) => words(text),
        Value::Array(items) => items
            .iter()
            .map(|i| words(i["content"].as_str().unwrap_or("")))
            .sum(),
        _ => 0,
    }
}

/// A Responses object.
fn response_object(id: &str, status: &str, text: &str, usage: Option<&Value>) -> Value {
    json!({"id": id, "object": "response", "created_at": 0, "model": MODEL,
        "status": status,
        "output": [{"type": "message", "id": format!("msg_{id}"), "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": usage})
}

async fn respond(State(state): State<Arc<AppState>>, Json(body): Json<Value>) -> Response {
    let max_tokens = body["max_output_tokens"].as_u64().unwrap_or(16) as usize;
    state.requests.lock().expect("lock").push(body.clone());
    let id = format!(
        "resp_{}",
        state.responses.fetch_add(1, Ordering::SeqCst) + 1
    );
    let reply = if max_tokens > 1 {
        (state.script)(state.scripted.fetch_add(1, Ordering::SeqCst), &body)
    } else {
        Reply::stream_ms(0, 0)
    };
    let earlier = match body["previous_response_id"].as_str() {
        None => 0,
        Some(previous) => match state.stored.lock().expect("lock").get(previous) {
            Some(&words) => words,
            None => {
                let message = format!("Previous response with id '{previous}' not found.");
                return ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
                    .into_response();
            }
        },
    };
    let new_input = input_words(&body["input"]);
    let instructions = words(body["instructions"].as_str().unwrap_or(""));
    let prompt = instructions + earlier + new_input;
    // Whether to ignore `stream: true` and answer one JSON object.
    let json_reply = body["stream"] != json!(true) || matches!(reply, Reply::Json);
    // How the stream ends: `Ok` completes, `Err(None)` breaks off, `Err(Some)` is an
    // error event.
    let (ttft, itl, tokens, finish): (_, _, _, Result<(), Option<String>>) = match reply {
        Reply::Error { status, message } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return ApiError::new(status, "scripted", message).into_response();
        }
        Reply::Stream { ttft, itl } => (ttft, itl, max_tokens, Ok(())),
        Reply::Truncated { after } => (Duration::ZERO, Duration::ZERO, after, Err(None)),
        Reply::ErrorEvent { after, message } => {
            (Duration::ZERO, Duration::ZERO, after, Err(Some(message)))
        }
        Reply::Json => (Duration::ZERO, Duration::ZERO, 1, Ok(())),
    };
    let text: String = (0..tokens).map(|i| format!(" tok{i}")).collect();
    let usage = json!({"input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": prompt - new_input},
        "output_tokens": tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + tokens as u64});
    if finish.is_ok() && body["store"] != json!(false) {
        let words = earlier + new_input + tokens as u64;
        state.stored.lock().expect("lock").insert(id.clone(), words);
    }
    let incomplete = body["ignore_eos"] == json!(true);
    let status = if incomplete {
        "incomplete"
    } else {
        "completed"
    };
    if json_reply {
        return Json(response_object(&id, status, &text, Some(&usage))).into_response();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let started = response_object(&id, "in_progress", "", None);
        let item = json!({"type": "message", "id": format!("msg_{id}"), "role": "assistant",
            "status": "in_progress", "content": []});
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        let opening = [
            response_event("response.created", json!({"response": started})),
            response_event("response.in_progress", json!({"response": started})),
            response_event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ),
            response_event(
                "response.content_part.added",
                json!({"output_index": 0, "content_index": 0, "part": part}),
            ),
        ];
        for event in opening {
            if tx.send(event).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(ttft).await;
        for i in 0..tokens {
            if i > 0 {
                tokio::time::sleep(itl).await;
            }
            let delta = json!({"output_index": 0, "content_index": 0, "delta": format!(" tok{i}")});
            if tx
                .send(response_event("response.output_text.delta", delta))
                .await
                .is_err()
            {
                return;
            }
        }
        match finish {
            Err(None) => return,
            Err(Some(message)) => {
                let error = json!({"code": "scripted", "message": message, "param": null});
                let _ = tx.send(response_event("error", error)).await;
                return;
            }
            Ok(()) => {}
        }
        let done_part = json!({"type": "output_text", "text": text, "annotations": []});
        let end = response_object(&id, status, &text, Some(&usage));
        let closing = [
            response_event(
                "response.output_text.done",
                json!({"output_index": 0, "content_index": 0, "text": text}),
            ),
            response_event(
                "response.content_part.done",
                json!({"output_index": 0, "content_index": 0, "part": done_part}),
            ),
            response_event(
                "response.output_item.done",
                json!({"output_index": 0, "item": end["output"][0]}),
            ),
            response_event(&format!("response.{status}"), json!({"response": end})),
        ];
        for event in closing {
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts")
}
