//! A worker over real HTTP on 127.0.0.1:0 with the real default model (SmolLM2-135M
//! Q4_1, fetched with pip on first use), for the test files that `mod support;` it.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use serde_json::{json, Value};

/// Bounds every test, model load included (2 slow CI cores).
pub const TEST_DEADLINE: Duration = Duration::from_secs(300);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

/// A started worker and a client for it.
pub struct TestWorker {
    worker: Worker,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// A client with a 120 s timeout.
    pub http: reqwest::Client,
}

impl TestWorker {
    /// Starts a worker with `extra` flags after the test defaults.
    pub async fn start(extra: &[&str]) -> Self {
        let model =
            pdserve_model::ensure_default_model(&pdserve_model::home_dir()).expect("default model");
        let mut argv = vec![
            "worker".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--served-model-name".into(),
            "smollm2".into(),
            "--threads".into(),
            "2".into(),
            "--num-kv-blocks".into(),
            "128".into(),
        ];
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

    /// POSTs `body` as JSON; the status and the JSON answer (null if not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// The `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
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

/// Runs `body` alone in its test binary (metrics must not see another test's traffic),
/// bounded in time.
pub async fn serial<F: std::future::Future<Output = ()>>(body: F) {
    let _guard = SERIAL.lock().await;
    tokio::time::timeout(TEST_DEADLINE, body)
        .await
        .expect("test timed out");
}

/// A greedy completion request for `prompt` with `extra` fields.
pub fn completion(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"model": "smollm2", "prompt": prompt, "temperature": 0});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// A greedy chat request with one user message and `extra` fields.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}
