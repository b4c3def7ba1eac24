//! A stand-in prefill worker on a real socket whose answers a test scripts: forward to a
//! real prefill worker, refuse (4xx), fail (5xx), never answer, or forward and then drop
//! the connection without answering (what a prefill worker killed mid-request looks
//! like to its client). Plain HTTP/1.1, one request per connection.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::http1::read_request;

/// How the stub answers `POST /v1/completions` (`GET /health` is always 200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward to the real prefill worker and answer with its answer.
    Proxy,
    /// 400 with [`REJECTION`].
    Reject,
    /// 500 with a plain-text body.
    Fail,
    /// Read the request, never answer.
    Hang,
    /// Forward to the real prefill worker (it computes and publishes the KV), then close
    /// the connection without answering.
    Drop,
    /// Forward without `kv_transfer_params.publish_request_id`, as a prefill worker that
    /// predates it would see the request (it publishes under an id of its own).
    ProxyWithoutPublishId,
    /// Forward without `return_token_ids`, as a prefill worker that predates it would
    /// see the request (its answer lists no token ids).
    ProxyWithoutTokenIds,
}

/// The stub's 400 body, OpenAI-shaped with a field the engine does not know.
pub const REJECTION: &str = r#"{"error":{"message":"the stub refuses this prompt","type":"invalid_request_error","param":"prompt","code":"stub_says_no","stub_detail":[1,2]}}"#;

/// A running stub.
pub struct PrefillStub {
    mode: Arc<Mutex<Mode>>,
    task: JoinHandle<()>,
}

impl PrefillStub {
    /// Serves on `listener`, forwarding to `upstream` (`http://host:port`) where asked.
    pub fn start(listener: TcpListener, upstream: String, mode: Mode) -> Self {
        let mode = Arc::new(Mutex::new(mode));
        let shared = mode.clone();
        let task = tokio::spawn(async move {
            let http = reqwest::Client::new();
            while let Ok((socket, _)) = listener.accept().await {
                let mode = *shared.lock().unwrap();
                tokio::spawn(serve(socket, mode, http.clone(), upstream.clone()));
            }
        });
        Self { mode, task }
    }

    /// Answers later requests as `mode` says.
    pub fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

impl Drop for PrefillStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut socket: TcpStream, mode: Mode, http: reqwest::Client, upstream: String) {
    let Some((head, body)) = read_request(&mut socket).await else {
        return;
    };
    if head.starts_with("GET /health") {
        return respond(&mut socket, 200, "application/json", br#"{"status":"ok"}"#).await;
    }
    match mode {
        Mode::Reject => respond(&mut socket, 400, "application/json", REJECTION.as_bytes()).await,
        Mode::Fail => respond(&mut socket, 500, "text/plain", b"the stub exploded").await,
        Mode::Hang => {
            // Hold the connection open until the client gives up.
            let mut sink = [0u8; 64];
            while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
        }
        Mode::Proxy | Mode::Drop | Mode::ProxyWithoutPublishId | Mode::ProxyWithoutTokenIds => {
            let body = if mode == Mode::ProxyWithoutPublishId {
                let mut json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                if let Some(params) = json["kv_transfer_params"].as_object_mut() {
                    params.remove("publish_request_id");
                }
                serde_json::to_vec(&json).unwrap()
            } else if mode == Mode::ProxyWithoutTokenIds {
                let mut json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                if let Some(fields) = json.as_object_mut() {
                    fields.remove("return_token_ids");
                }
                serde_json::to_vec(&json).unwrap()
            } else {
                body
            };
            let answer = http
                .post(format!("{upstream}/v1/completions"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            let Ok(answer) = answer else {
                return respond(&mut socket, 502, "text/plain", b"upstream unreachable").await;
            };
            let status = answer.status().as_u16();
            let bytes = answer.bytes().await.unwrap_or_default();
            if mode != Mode::Drop {
                respond(&mut socket, status, "application/json", &bytes).await;
            }
            // Mode::Drop: the socket closes here with no answer.
        }
    }
}

async fn respond(socket: &mut TcpStream, status: u16, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(body).await;
    let _ = socket.shutdown().await;
}
