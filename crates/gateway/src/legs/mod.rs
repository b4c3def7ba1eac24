//! The legs every handoff mode is made of: sending a leg to a worker and reading its
//! answer ([`crate::clients::worker_client::Exchange`]), the prefill leg ([`prefill`]), the leg
//! that answers the client ([`answer`]) and its stream relay ([`relay`]), and the retry
//! budget ([`retry`]).

pub mod answer;
pub mod first_token;
pub mod first_token_guard;
pub mod first_token_watch;
pub mod prefill;
pub mod prompt_logprobs;
pub mod relay;
pub mod retry;
pub mod sse;

use std::time::Instant;

use http::HeaderMap;

use crate::clients::worker_client::ForwardHeaders;
use crate::endpoint::Endpoint;
use crate::ingress::request::ClientRequest;
use crate::policy::{RouteRequest, RoutingNotes};

/// With `--expose-routing`: the prefill worker that served the request.
pub const X_PDSERVE_PREFILL: &str = "x-pdserve-prefill";
/// With `--expose-routing`: the decode worker that served the request.
pub const X_PDSERVE_DECODE: &str = "x-pdserve-decode";
/// With `--expose-routing`: the prefill_decode worker that served the request.
pub const X_PDSERVE_WORKER: &str = "x-pdserve-worker";
/// With `--expose-routing`: what the prefill worker held of the prompt when chosen
/// (`events; matched=128; prompt=300; unit=tokens`).
pub const X_PDSERVE_PREFILL_CACHE: &str = "x-pdserve-prefill-cache";
/// With `--expose-routing`: what the decode worker held of the prompt when chosen.
pub const X_PDSERVE_DECODE_CACHE: &str = "x-pdserve-decode-cache";
/// With `--expose-routing`: what the prefill_decode worker held of the prompt when chosen.
pub const X_PDSERVE_WORKER_CACHE: &str = "x-pdserve-worker-cache";
/// With `--expose-routing` and `--policy slo`: what the prefill worker was predicted to
/// give the request when chosen (`ttft_ms=412.3`).
pub const X_PDSERVE_PREFILL_PREDICTED: &str = "x-pdserve-prefill-predicted";
/// With `--expose-routing` and `--policy slo`: the decode worker's prediction
/// (`ttft_ms=35.0; tpot_ms=31.2`).
pub const X_PDSERVE_DECODE_PREDICTED: &str = "x-pdserve-decode-predicted";
/// With `--expose-routing` and `--policy slo`: the prefill_decode worker's prediction.
pub const X_PDSERVE_WORKER_PREDICTED: &str = "x-pdserve-worker-predicted";

/// Per-request facts every leg needs.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The OpenAI endpoint, used for the worker URL.
    pub endpoint: Endpoint,
    /// The route label for metrics.
    pub route: &'static str,
    /// Headers sent on every leg.
    pub headers: ForwardHeaders,
    /// The client's headers, for routing policies (shared: a streamed P/D answer's
    /// decode leg runs on a clone of the context).
    pub client_headers: std::sync::Arc<HeaderMap>,
    /// When the client request arrived.
    pub started: Instant,
    /// The prompt's token ids as the workers will compute them (`--tokenizer`).
    pub prompt_tokens: Option<std::sync::Arc<[u32]>>,
    /// The chosen workers' cache matches, kept with `--expose-routing` only.
    pub routing_notes: Option<std::sync::Arc<RoutingNotes>>,
    /// The workers that served the request and how it ended, for the dashboard.
    pub journey: std::sync::Arc<crate::observe::journey::Journey>,
    /// The request's server span, when it is traced (`--otlp-traces-endpoint`).
    pub trace: Option<pdserve_telemetry::Context>,
    /// Its latency objectives (`x-slo-*` headers, else `--slo-*`), set at intake.
    pub slo: crate::ingress::slo::Slo,
    /// Its priority (vLLM's `priority`, else `x-pdserve-priority`; lower goes first), set
    /// at intake.
    pub priority: i64,
}

impl RequestContext {
    /// The context of a request to `route` that arrived now with the client's `headers`.
    pub fn new(endpoint: Endpoint, route: &'static str, headers: HeaderMap) -> Self {
        let mut forward = ForwardHeaders::from_client(&headers);
        let trace = crate::observe::trace::request_context(&mut forward);
        let started = Instant::now();
        let journey =
            crate::observe::journey::Journey::new(forward.request_id.clone(), route, started);
        Self {
            endpoint,
            route,
            headers: forward,
            client_headers: std::sync::Arc::new(headers),
            started,
            prompt_tokens: None,
            routing_notes: None,
            journey: std::sync::Arc::new(journey),
            trace,
            slo: Default::default(),
            priority: 0,
        }
    }

    /// The routing facts of `request`.
    pub fn route_for<'a>(
        &'a self,
        request: &'a ClientRequest,
        conversation_id: Option<&'a str>,
    ) -> RouteRequest<'a> {
        RouteRequest {
            endpoint: self.endpoint,
            request: Some(request),
            headers: &self.client_headers,
            conversation_id,
            tokens: self.prompt_tokens.as_deref(),
            notes: self.routing_notes.as_deref(),
            trace: self.trace.as_ref(),
            prefer: None,
            seen: Some(self.journey.seen()),
            slo: self.slo,
            local_prefill: false,
        }
    }
}
