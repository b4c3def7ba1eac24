//! Routing policies: which live worker of a role serves a request.
//!
//! A policy sees the live workers the registry offers (minus those a retry already
//! tried) and the request's routing facts; it is told when each request it routed ends,
//! so load- and outcome-aware policies can keep their own state.

mod round_robin;

use std::fmt;
use std::sync::Arc;

use http::HeaderMap;
use pdserve_protocol::{Prompt, WorkerRole};

use crate::endpoint::Endpoint;
use crate::registry::Worker;
use crate::validation::GenerateRequest;
pub use round_robin::RoundRobin;

/// What a policy may route on.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The endpoint the request targets.
    pub endpoint: Endpoint,
    /// The validated generation request, when the route carries one.
    pub request: Option<&'a GenerateRequest>,
    /// The client's headers (session ids and the like).
    pub headers: &'a HeaderMap,
    /// The gateway's `conversation_id`, when the client sent one.
    pub conversation_id: Option<&'a str>,
}

/// A request's prompt as a policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum RoutePrompt<'a> {
    /// Prompt text (chat messages are joined in order, each prefixed by its role).
    Text(String),
    /// Prompt token ids, when the client sent them.
    TokenIds(&'a [u32]),
}

impl<'a> RouteRequest<'a> {
    /// A context for a request without a body (e.g. `/v1/models`).
    pub fn bodyless(endpoint: Endpoint, headers: &'a HeaderMap) -> Self {
        Self {
            endpoint,
            request: None,
            headers,
            conversation_id: None,
        }
    }

    /// The prompt (the first one of a batch), computed on demand so policies that do
    /// not look at it cost nothing.
    pub fn prompt(&self) -> Option<RoutePrompt<'a>> {
        match self.request? {
            GenerateRequest::Chat(chat) => {
                let mut text = String::new();
                for m in &chat.messages {
                    text.push_str(&m.role);
                    text.push('\n');
                    if let Some(content) = &m.content {
                        text.push_str(&content.text());
                    }
                    text.push('\n');
                }
                Some(RoutePrompt::Text(text))
            }
            GenerateRequest::Completion(c) => match &c.prompt {
                Prompt::Text(t) => Some(RoutePrompt::Text(t.clone())),
                Prompt::Texts(t) => t.first().map(|t| RoutePrompt::Text(t.clone())),
                Prompt::Tokens(ids) => Some(RoutePrompt::TokenIds(ids)),
                Prompt::TokenBatches(b) => b.first().map(|ids| RoutePrompt::TokenIds(ids)),
            },
        }
    }
}

/// How a routed request ended on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The worker answered and the answer reached the client.
    Success,
    /// The worker failed (transport error, 5xx, malformed answer, timeout).
    Failure,
    /// The request ended for another reason (client error, client gone, retry elsewhere).
    Other,
}

/// Chooses workers for requests.
pub trait Policy: fmt::Debug + Send + Sync {
    /// The policy's name (`--policy` value).
    fn name(&self) -> &'static str;

    /// One of `candidates` (live workers of `role`, none tried yet by this request), or
    /// `None` when there are none.
    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>>;

    /// A prefill worker and a decode worker for one request.
    fn select_pair(
        &self,
        prefill: &[Arc<Worker>],
        decode: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<(Arc<Worker>, Arc<Worker>)> {
        let p = self.select(WorkerRole::Prefill, prefill, request)?;
        let d = self.select(WorkerRole::Decode, decode, request)?;
        Some((p, d))
    }

    /// Called once for every request this policy routed, when it ends on `worker`.
    fn on_request_end(&self, worker: &Worker, outcome: RequestOutcome) {
        let _ = (worker, outcome);
    }
}

/// The policy named `name`.
pub fn by_name(name: &str) -> Option<Arc<dyn Policy>> {
    match name {
        "round_robin" => Some(Arc::new(RoundRobin::default())),
        _ => None,
    }
}

/// Every `--policy` name this build knows.
pub const POLICY_NAMES: &[&str] = &["round_robin"];
