//! Fakes shared by the policy tests: workers on made-up ports, load, requests.

use std::sync::Arc;

use http::HeaderMap;
use pdserve_protocol::WorkerRole;
use prometheus_client::metrics::gauge::Gauge;

use super::{Policy, RoundRobin};
use crate::endpoint::Endpoint;
use crate::fleet::registry::{Worker, WorkerSpec};
use crate::ingress::request::ClientRequest;
use crate::policy::InFlight;

/// Workers of `role` at `http://127.0.0.1:{port}`.
pub fn workers(role: WorkerRole, ports: &[u16]) -> Vec<Arc<Worker>> {
    ports
        .iter()
        .map(|p| {
            let url = reqwest::Url::parse(&format!("http://127.0.0.1:{p}")).unwrap();
            Arc::new(Worker::new(WorkerSpec::new(role, url), Gauge::default()))
        })
        .collect()
}

/// `n` open requests on `worker` for as long as the returned guards live.
pub fn load(worker: &Arc<Worker>, n: usize) -> Vec<InFlight> {
    let policy: Arc<dyn Policy> = Arc::new(RoundRobin::default());
    (0..n)
        .map(|_| InFlight::start(worker.clone(), policy.clone()))
        .collect()
}

/// A chat request with one user message.
pub fn chat(content: &str) -> ClientRequest {
    let body = serde_json::json!({"messages": [{"role": "user", "content": content}]});
    ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
        .unwrap()
        .0
}

/// A chat request from OpenAI `user` `user`.
pub fn chat_from(content: &str, user: &str) -> ClientRequest {
    let body =
        serde_json::json!({"messages": [{"role": "user", "content": content}], "user": user});
    ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
        .unwrap()
        .0
}

/// A completion request with token ids.
pub fn tokens(ids: &[u32]) -> ClientRequest {
    let body = serde_json::json!({"prompt": ids});
    ClientRequest::parse(Endpoint::Completions, body.to_string().as_bytes())
        .unwrap()
        .0
}

/// The base URL of the worker `policy` picks for `request` (with no headers).
pub fn pick(
    policy: &dyn Policy,
    role: WorkerRole,
    candidates: &[Arc<Worker>],
    request: &ClientRequest,
) -> String {
    let headers = HeaderMap::new();
    let route = super::RouteRequest {
        endpoint: Endpoint::Chat,
        request: Some(request),
        headers: &headers,
        conversation_id: None,
        tokens: None,
        notes: None,
        prefer: None,
        trace: None,
        seen: None,
        slo: Default::default(),
        local_prefill: false,
    };
    policy
        .select(role, candidates, &route)
        .unwrap()
        .base
        .clone()
}

/// Index of the worker whose base URL is `base`.
pub fn index_of(candidates: &[Arc<Worker>], base: &str) -> usize {
    candidates.iter().position(|w| w.base == base).unwrap()
}
