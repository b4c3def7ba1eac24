//! Issue 14, gateway side: numbers passed as sent, the context check before prefill, the
//! release of P's handle when decode fails, P's cached tokens in the client's usage,
//! read timeouts, a client leaving a non-stream request, `--api-key`, request ids.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use pdserve_gateway::fleet::registry::parse_worker_url;

use super::{bounded, client, sse_data, Gateway};

/// How the stub answers generation requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Like vLLM (a `temperature` that overflows f32 gets the worker's 400).
    Normal,
    /// 400, as a decode worker refusing the request.
    Reject,
    /// A non-stream request that never finishes (counted as cancelled when dropped).
    Hold,
}

#[derive(Debug, Clone)]
struct Rec {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

struct Shared {
    prefill: bool,
    /// No release route (vLLM): `POST /v1/kv/release` gets 404.
    no_release_route: std::sync::atomic::AtomicBool,
    mode: Mutex<Mode>,
    seen: Mutex<Vec<Rec>>,
    cancelled: AtomicUsize,
}

/// A worker stub that records every request byte for byte.
struct Stub {
    url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Stub {
    async fn start(prefill: bool) -> Self {
        let shared = Arc::new(Shared {
            prefill,
            no_release_route: Default::default(),
            mode: Mutex::new(Mode::Normal),
            seen: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
        });
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, shared, task }
    }

    fn set(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    fn seen(&self, path: &str) -> Vec<Rec> {
        let seen = self.shared.seen.lock().unwrap();
        seen.iter().filter(|r| r.path == path).cloned().collect()
    }

    async fn wait_for(&self, path: &str, n: usize) -> Vec<Rec> {
        loop {
            let seen = self.seen(path);
            if seen.len() >= n {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

struct Cancelled(Arc<Shared>);

impl Drop for Cancelled {
    fn drop(&mut self) {
        self.0.cancelled.fetch_add(1, Ordering::SeqCst);
    }
}

const P_HANDLE: &str = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"engine-P","remote_request_id":"P-req","remote_host":"127.0.0.1","remote_port":5600}"#;

async fn handle(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    shared.seen.lock().unwrap().push(Rec {
        method: method.clone(),
        path: path.clone(),
        headers,
        body: body.clone(),
    });
    match path.as_str() {
        "/health" => return StatusCode::OK.into_response(),
        "/v1/models" => {
            return axum::Json(json!({"object": "list", "data": [
                {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 64}]}))
            .into_response()
        }
        "/v1/kv/release" if shared.no_release_route.load(Ordering::SeqCst) => {
            return (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            )
                .into_response()
        }
        "/v1/kv/release" => return axum::Json(json!({"released": true})).into_response(),
        "/v1/chat/completions" | "/v1/completions" => {}
        _ => return StatusCode::NOT_FOUND.into_response(),
    }
    let request: Value = serde_json::from_slice(&body).unwrap();
    // A pdserve worker reads temperature as f32: 1e39 overflows and is refused.
    let temperature = request["temperature"].as_f64().unwrap_or(1.0) as f32;
    let mode = *shared.mode.lock().unwrap();
    if mode == Mode::Reject || !temperature.is_finite() {
        let error = json!({"error": {"message": "rejected", "type": "BadRequestError",
                                     "param": null, "code": 400}});
        return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
    }
    if mode == Mode::Hold {
        let _guard = Cancelled(shared.clone());
        std::future::pending::<()>().await;
    }
    if shared.prefill {
        let answer = format!(
            r#"{{"id":"cmpl-p","object":"text_completion","created":0,"model":"m","choices":[{{"index":0,"text":"x","finish_reason":"length"}}],"usage":{{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{{"cached_tokens":3}}}},"kv_transfer_params":{P_HANDLE}}}"#
        );
        return ([("content-type", "application/json")], answer).into_response();
    }
    let usage = json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                       "prompt_tokens_details": {"cached_tokens": 0}});
    if request["stream"] == true {
        let mut events = String::new();
        for chunk in [
            json!({"id": "c", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}]}),
            json!({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}),
        ] {
            events.push_str(&format!("data: {chunk}\n\n"));
        }
        events.push_str("data: [DONE]\n\n");
        return ([("content-type", "text/event-stream")], Body::from(events)).into_response();
    }
    axum::Json(
        json!({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "finish_reason": "length"}],
        "usage": usage}),
    )
    .into_response()
}

fn config(p: &Stub, d: &Stub) -> GatewayConfig {
    let url = |s: &Stub| vec![parse_worker_url("test", &s.url).unwrap()];
    GatewayConfig::new(url(p), url(d), Vec::new())
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn post(gw: &Gateway, body: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = client()
        .post(gw.at("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test]
async fn numbers_reach_the_workers_as_sent_and_overflow_is_refused() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let gw = Gateway::start(config(&p, &d)).await;
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"top_p":0.95,"seed":123456789012345678901234567890,"presence_penalty":0.300000000000000000000000001,"min_p":5E-2}"#;
        let (status, text) = post(&gw, body, &[]).await;
        assert_eq!(status, 200, "{text}");
        for leg in [p.seen("/v1/chat/completions"), d.seen("/v1/chat/completions")] {
            let sent = String::from_utf8(leg[0].body.to_vec()).unwrap();
            for kept in [
                r#""top_p":0.95"#,
                r#""seed":123456789012345678901234567890"#,
                r#""presence_penalty":0.300000000000000000000000001"#,
                r#""min_p":5E-2"#,
            ] {
                assert!(sent.contains(kept), "{kept} not in {sent}");
            }
        }
        // 1e39 used to become f32 infinity, then null: a 200 with default sampling.
        let (status, text) = post(
            &gw,
            r#"{"messages":[{"role":"user","content":"hi"}],"temperature":1e39}"#,
            &[],
        )
        .await;
        assert_eq!(status, 400, "{text}");
        let sent = String::from_utf8(p.seen("/v1/chat/completions")[1].body.to_vec()).unwrap();
        assert!(sent.contains(r#""temperature":1e39"#), "{sent}");
    })
    .await;
}

#[tokio::test]
async fn max_tokens_beyond_the_context_is_refused_before_prefill() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let gw = Gateway::start(config(&p, &d)).await;
        // The gateway fetches the workers' /v1/models (max_model_len 64) on start.
        d.wait_for("/v1/models", 1).await;
        let too_long = chat(json!({"max_tokens": 64})).to_string();
        let (status, text) = loop {
            let before = p.seen("/v1/chat/completions").len();
            let (status, text) = post(&gw, &too_long, &[]).await;
            if status == 400 {
                assert_eq!(p.seen("/v1/chat/completions").len(), before, "P was asked");
                break (status, text);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(status, 400);
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["param"], "max_tokens");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length is 64 tokens"),
            "{text}"
        );
        let (status, _) = post(&gw, &chat(json!({"max_tokens": 63})).to_string(), &[]).await;
        assert_eq!(status, 200);
    })
    .await;
}

#[tokio::test]
async fn decode_refusal_after_prefill_releases_the_prefill_handle() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        d.set(Mode::Reject);
        let mut config = config(&p, &d);
        config.kv_secret = Some("s3cret".into());
        let gw = Gateway::start(config).await;
        let (status, _) = post(&gw, &chat(json!({"max_tokens": 3})).to_string(), &[]).await;
        assert_eq!(status, 400);
        let release = p.wait_for("/v1/kv/release", 1).await;
        assert_eq!(release[0].method, Method::POST);
        let body: Value = serde_json::from_slice(&release[0].body).unwrap();
        let handle: Value = serde_json::from_str(P_HANDLE).unwrap();
        assert_eq!(body["kv_transfer_params"], handle);
        assert_eq!(release[0].headers["x-pdserve-kv-secret"], "s3cret");
        // A successful request releases nothing.
        d.set(Mode::Normal);
        let (status, _) = post(&gw, &chat(json!({"max_tokens": 3})).to_string(), &[]).await;
        assert_eq!(status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(p.seen("/v1/kv/release").len(), 1);
    })
    .await;
}

#[tokio::test]
async fn decode_refusal_after_an_encoded_prefill_releases_the_prefill_handle() {
    bounded(async {
        let encoder = super::encoder::Encoder::start("e0").await;
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        d.set(Mode::Reject);
        let mut config = config(&p, &d);
        config.encode = vec![parse_worker_url("test", &encoder.url).unwrap()];
        let gw = Gateway::start(config).await;
        let body = super::epd::mm_request(&[super::epd::image("a")], false);
        let (status, text) = post(&gw, &body.to_string(), &[]).await;
        assert_eq!(status, 400, "{text}");
        assert_eq!(encoder.requests().len(), 1, "the E+P+D path ran");
        let release = p.wait_for("/v1/kv/release", 1).await;
        let sent: Value = serde_json::from_slice(&release[0].body).unwrap();
        let handle: Value = serde_json::from_str(P_HANDLE).unwrap();
        assert_eq!(sent["kv_transfer_params"], handle);
    })
    .await;
}

#[tokio::test]
async fn a_worker_without_the_release_route_is_asked_once() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        p.shared.no_release_route.store(true, Ordering::SeqCst);
        d.set(Mode::Reject);
        let gw = Gateway::start(config(&p, &d)).await;
        let (status, _) = post(&gw, &chat(json!({"max_tokens": 3})).to_string(), &[]).await;
        assert_eq!(status, 400);
        p.wait_for("/v1/kv/release", 1).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(p.seen("/v1/kv/release").len(), 1, "a 404 is not retried");
    })
    .await;
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// One thread: the thread-local subscriber sees the gateway's tasks too.
#[tokio::test(flavor = "current_thread")]
async fn every_request_gets_one_access_log_line_with_its_id() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let gw = Gateway::start(config(&p, &d)).await;
        let (status, _) = post(
            &gw,
            &chat(json!({"max_tokens": 2})).to_string(),
            &[("x-request-id", "acc-1")],
        )
        .await;
        assert_eq!(status, 200);
        let health = client().get(gw.at("/health")).send().await.unwrap();
        assert_eq!(health.status(), 200);
    })
    .await;
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let access: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pdserve::access"))
        .collect();
    let chat_lines: Vec<&&str> = access.iter().filter(|l| l.contains("acc-1")).collect();
    assert_eq!(chat_lines.len(), 1, "{log}");
    let line = chat_lines[0];
    assert!(line.contains(" INFO "), "{line}");
    for part in ["POST", "/v1/chat/completions", "status=200", "latency_ms="] {
        assert!(line.contains(part), "{part} missing: {line}");
    }
    assert!(
        access
            .iter()
            .any(|l| l.contains("/health") && l.contains("GET")),
        "{log}"
    );
}

#[tokio::test]
async fn client_usage_reports_the_prefill_legs_cached_tokens() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let gw = Gateway::start(config(&p, &d)).await;
        let (status, text) = post(&gw, &chat(json!({"max_tokens": 2})).to_string(), &[]).await;
        assert_eq!(status, 200, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
        assert_eq!(body["usage"]["completion_tokens"], 2);
        let stream = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
        let (status, text) = post(&gw, &stream.to_string(), &[]).await;
        assert_eq!(status, 200);
        let data = sse_data(&text);
        let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
        assert_eq!(data.last().unwrap(), "[DONE]");
    })
    .await;
}

#[tokio::test]
async fn a_client_leaving_a_non_stream_request_cancels_decode_and_releases_prefill() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        d.set(Mode::Hold);
        let gw = Gateway::start(config(&p, &d)).await;
        let url = gw.at("/v1/chat/completions");
        let request = tokio::spawn(async move {
            client()
                .post(url)
                .json(&chat(json!({"max_tokens": 3})))
                .send()
                .await
        });
        d.wait_for("/v1/chat/completions", 1).await;
        request.abort();
        // Dropping the client's request drops the decode leg: the stub sees it close.
        while d.shared.cancelled.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        p.wait_for("/v1/kv/release", 1).await;
    })
    .await;
}

#[tokio::test]
async fn api_key_guards_the_openai_routes_and_workers_get_their_own() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let mut config = config(&p, &d);
        config.api_key = Some("client-key".into());
        config.worker_api_key = Some("worker-key".into());
        let gw = Gateway::start(config).await;
        let body = chat(json!({"max_tokens": 2})).to_string();
        for auth in [None, Some("Bearer wrong"), Some("client-key")] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let (status, text) = post(&gw, &body, &headers).await;
            assert_eq!(status, 401, "{auth:?}: {text}");
            let error: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(error["error"]["code"], "invalid_api_key");
        }
        let models = client().get(gw.at("/v1/models")).send().await.unwrap();
        assert_eq!(models.status(), 401);
        for open in ["/health", "/liveness", "/metrics"] {
            let r = client().get(gw.at(open)).send().await.unwrap();
            assert_ne!(r.status(), 401, "{open}");
        }
        assert!(p.seen("/v1/chat/completions").is_empty());
        let (status, text) = post(
            &gw,
            &body,
            &[
                ("authorization", "Bearer client-key"),
                ("x-request-id", "req-42"),
            ],
        )
        .await;
        assert_eq!(status, 200, "{text}");
        for leg in [&p, &d] {
            let sent = &leg.seen("/v1/chat/completions")[0];
            assert_eq!(sent.headers["authorization"], "Bearer worker-key");
            assert_eq!(sent.headers["x-request-id"], "req-42");
        }
    })
    .await;
}

/// Everything the gateway sends until it closes the connection.
async fn read_to_close(stream: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("the gateway kept the connection open")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn half_sent_heads_and_bodies_are_cut_off() {
    bounded(async {
        let (p, d) = (Stub::start(true).await, Stub::start(false).await);
        let mut config = config(&p, &d);
        config.serve.header_read_timeout = Duration::from_millis(300);
        config.serve.body_read_timeout = Duration::from_millis(300);
        let gw = Gateway::start(config).await;
        let addr = gw.url.trim_start_matches("http://").to_string();
        let mut half_head = tokio::net::TcpStream::connect(&addr).await.unwrap();
        half_head
            .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await
            .unwrap();
        let answer = read_to_close(&mut half_head).await;
        assert!(!answer.contains("200 OK"), "{answer}");
        let mut half_body = tokio::net::TcpStream::connect(&addr).await.unwrap();
        half_body
            .write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"messages\":",
            )
            .await
            .unwrap();
        let answer = read_to_close(&mut half_body).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("request_timeout"), "{answer}");
        assert!(p.seen("/v1/chat/completions").is_empty());
    })
    .await;
}
