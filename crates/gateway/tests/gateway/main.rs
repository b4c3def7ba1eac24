//! Integration tests: the gateway and vLLM worker doubles on real 127.0.0.1 sockets.

mod bootstrap;
mod control_plane;
mod conversations;
mod dashboard;
mod discovery;
mod dns;
mod double;
mod encoder;
mod epd;
mod epd_failures;
mod failures;
mod first_token;
mod handoff;
mod hardening;
mod kube_api;
mod kubernetes;
mod kv_events;
mod kv_routing;
mod load;
mod loops;
mod multiturn;
mod overload;
mod routing;
mod sglang_double;

use std::future::Future;
use std::time::{Duration, Instant};

use pdserve_gateway::fleet::registry::parse_worker_url;
use pdserve_gateway::{GatewayConfig, GatewayError};
use reqwest::Url;
use serde_json::Value;
use tokio::sync::oneshot;

use double::Double;

/// One roster member as `(url, role, source)`.
pub type RosterRow = (String, String, String);

/// A gateway serving on a free port; shut down when dropped.
pub struct Gateway {
    pub url: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), GatewayError>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Graceful shutdown waits for open streams; a test must not.
        self.task.abort();
    }
}

impl Gateway {
    pub async fn start(config: GatewayConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(pdserve_gateway::serve(listener, config, async {
            let _ = rx.await;
        }));
        Self {
            url,
            shutdown: Some(tx),
            task,
        }
    }

    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// `GET /instances` as JSON.
    pub async fn instances(&self) -> Value {
        client()
            .get(self.at("/instances"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// The gateway's open requests on the worker at `url`, from `/instances`.
    pub async fn in_flight(&self, url: &str) -> i64 {
        let instances = self.instances().await;
        instances["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == url)
            .unwrap_or_else(|| panic!("{url} is not in {instances}"))["in_flight"]
            .as_i64()
            .unwrap()
    }

    /// The roster as sorted `(url, role, source)` rows, from `/instances`.
    pub async fn roster(&self) -> Vec<RosterRow> {
        let instances = self.instances().await;
        let mut rows: Vec<RosterRow> = instances["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                let s = |k: &str| w[k].as_str().unwrap_or_default().to_string();
                (s("url"), s("role"), s("source"))
            })
            .collect();
        rows.sort();
        rows
    }

    /// Waits (up to 10 s) until the roster is `expected`; returns how long after `since`
    /// that was.
    pub async fn roster_becomes(&self, expected: &[RosterRow], since: Instant) -> Duration {
        let mut expected = expected.to_vec();
        expected.sort();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.roster().await == expected {
                return since.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("roster {:?}, expected {expected:?}", self.roster().await);
    }

    /// The status of a small chat request.
    pub async fn chat_status(&self) -> u16 {
        let body =
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        client()
            .post(self.at("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    /// `GET /health` as JSON.
    pub async fn health(&self) -> Value {
        client()
            .get(self.at("/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

pub fn urls(doubles: &[&Double]) -> Vec<Url> {
    doubles
        .iter()
        .map(|d| parse_worker_url("test", &d.url).unwrap())
        .collect()
}

/// A P/D configuration over the given doubles.
pub fn pd_config(prefill: &[&Double], decode: &[&Double]) -> GatewayConfig {
    GatewayConfig::new(urls(prefill), urls(decode), Vec::new())
}

/// The sum of the `/metrics` samples whose line starts with `name` (labels included).
pub async fn metric(gw: &Gateway, name: &str) -> f64 {
    let text = client()
        .get(gw.at("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// Runs a test body with a hard time limit.
pub async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test exceeded its time limit")
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}
