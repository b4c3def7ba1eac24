//! Integration tests: the gateway and vLLM worker doubles on real 127.0.0.1 sockets.

mod bootstrap;
mod control_plane;
mod discovery;
mod dns;
mod double;
mod encoder;
mod epd;
mod epd_failures;
mod failures;
mod handoff;
mod hardening;
mod kube_api;
mod kubernetes;
mod loops;
mod multiturn;
mod routing;
mod sglang_double;

use std::future::Future;
use std::time::Duration;

use pdserve_gateway::args::parse_worker_url;
use pdserve_gateway::{GatewayConfig, GatewayError};
use reqwest::Url;
use serde_json::Value;
use tokio::sync::oneshot;

use double::Double;

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
