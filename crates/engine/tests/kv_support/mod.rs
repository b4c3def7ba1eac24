//! In-process pdserve workers (real default model) on 127.0.0.1:0 for the KV handoff
//! tests, and the P/D legs as vLLM's proxy drives them.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use serde_json::{json, Value};

/// Bounds every test, model loads included (2 slow CI cores).
pub const TEST_DEADLINE: Duration = Duration::from_secs(300);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

/// A worker and an HTTP client for it.
pub struct TestWorker {
    pub worker: Worker,
    pub base: String,
    pub http: reqwest::Client,
}

impl TestWorker {
    /// Starts a worker with `extra` flags.
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

    /// POSTs `body` with extra headers; the status and JSON body.
    pub async fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut request = self.http.post(format!("{}{path}", self.base)).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let resp = request.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// POSTs `body`; the status and JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_with(path, body, &[]).await
    }

    /// POSTs `body` and expects 200.
    pub async fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, answer) = self.post(path, body).await;
        assert_eq!(status, 200, "{path}: {answer}");
        answer
    }

    /// A metric's value from `/metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
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
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Drains and stops the worker.
    pub async fn stop(self) {
        self.worker.shutdown().await.expect("clean shutdown");
    }
}

/// A greedy completion request.
pub fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// The prefill leg of `prompt` (`do_remote_decode`), with `params` merged in.
pub fn prefill_leg(prompt: &str, params: Value) -> Value {
    let mut body = completion(prompt, 16);
    let mut kv = json!({"do_remote_decode": true, "do_remote_prefill": false});
    if let Value::Object(extra) = params {
        kv.as_object_mut().unwrap().extend(extra);
    }
    kv["do_remote_decode"] = json!(true);
    kv["do_remote_prefill"] = json!(false);
    body["kv_transfer_params"] = kv;
    body
}

/// The decode leg of `prompt` reading the KV named by `params` (a prefill's answer).
pub fn decode_leg(prompt: &str, max_tokens: u32, params: &Value) -> Value {
    let mut body = completion(prompt, max_tokens);
    body["kv_transfer_params"] = params.clone();
    body
}

/// The completion text of an answer.
pub fn text_of(answer: &Value) -> String {
    answer["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The metric of KV blocks pinned for peers.
pub const PINNED: &str = "pdserve_kv_transfer_pinned_blocks";
