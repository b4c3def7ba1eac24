//! A worker started in process on 127.0.0.1:0, and an HTTP client for it.

use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use pdserve_engine::{Worker, WorkerArgs};
use pdserve_protocol::sse::{messages, SseMessage};
use serde_json::Value;

/// Flags every test worker gets unless the test gives the same flag itself: the name the
/// request builders send, a share of the 2 CI cores, and a small KV cache.
const DEFAULT_FLAGS: [(&str, &str); 3] = [
    ("--served-model-name", "smollm2"),
    ("--threads", "2"),
    ("--num-kv-blocks", "128"),
];

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

/// A started worker and a client for it.
pub struct TestWorker {
    /// The worker itself (its address, health and shutdown).
    pub worker: Worker,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// A client with a 120 s timeout.
    pub http: reqwest::Client,
}

impl TestWorker {
    /// Starts a worker with the default model, `extra` flags and the defaults of the
    /// flags `extra` does not give (as `--flag value`, not `--flag=value`).
    pub async fn start(extra: &[&str]) -> Self {
        let model =
            pdserve_model::ensure_default_model(&pdserve_model::home_dir()).expect("default model");
        let mut argv = vec![
            "worker".to_string(),
            "--model".into(),
            model.display().to_string(),
        ];
        for (flag, value) in DEFAULT_FLAGS {
            if !extra.contains(&flag) {
                argv.extend([flag.to_string(), value.to_string()]);
            }
        }
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = Cli::try_parse_from(argv).expect("worker args").args;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let worker = Worker::start(listener, args).await.expect("worker starts");
        let base = format!("http://{}", worker.local_addr());
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        Self { worker, base, http }
    }

    /// The full URL of `path` on this worker.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// GETs `path`; the status and the JSON answer (null if not JSON).
    pub async fn get(&self, path: &str) -> (u16, Value) {
        answer(self.http.get(self.url(path))).await
    }

    /// POSTs `body` as JSON; the status and the JSON answer (null if not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_with(path, body, &[]).await
    }

    /// POSTs `body` as JSON with extra headers; the status and the JSON answer.
    pub async fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut request = self.http.post(self.url(path)).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        answer(request).await
    }

    /// POSTs `body` verbatim as `application/json` (for bodies that are not valid JSON).
    pub async fn post_raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        let request = self
            .http
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body);
        answer(request).await
    }

    /// POSTs `body` and expects 200; the JSON answer.
    pub async fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, answer) = self.post(path, body).await;
        assert_eq!(status, 200, "{path}: {answer}");
        answer
    }

    /// The data events of a streamed request, `[DONE]` included as the string "[DONE]".
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        self.stream_timed(path, body)
            .await
            .into_iter()
            .map(|(_, v)| v)
            .collect()
    }

    /// Like `stream`, with the arrival time of each event.
    pub async fn stream_timed(&self, path: &str, body: &Value) -> Vec<(Instant, Value)> {
        let resp = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let content_type = resp.headers()["content-type"].to_str().unwrap().to_string();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        messages(resp.bytes_stream())
            .map(|m| {
                let value = match m.unwrap() {
                    SseMessage::Data(d) => serde_json::from_str(&d).unwrap(),
                    SseMessage::Done => Value::String("[DONE]".into()),
                };
                (Instant::now(), value)
            })
            .collect()
            .await
    }

    /// The `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        let resp = self.http.get(self.url("/metrics")).send().await.unwrap();
        resp.text().await.unwrap()
    }

    /// A series' value from `/metrics` (`name` includes any labels; 0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics_text()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    /// Waits (bounded) until `name` reads `want`.
    pub async fn wait_metric(&self, name: &str, want: f64) {
        let start = Instant::now();
        loop {
            let got = self.metric(name).await;
            if got == want {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} stuck at {got}, want {want}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Drains and stops the worker.
    pub async fn stop(self) {
        self.worker.shutdown().await.expect("clean shutdown");
    }
}

/// Sends `request`; the status and the JSON answer (null if not JSON).
async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = request.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}
