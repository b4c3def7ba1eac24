//! The serving context: the engine and what every way of serving a request (the OpenAI
//! routes, SGLang's bootstrap rooms, the orchestrator) submits through.

use std::sync::Arc;

use pdserve_model::Model;
use pdserve_protocol::{ApiError, KvTransferParams};

use super::{Generation, ModelLimits};
use crate::kv::{handoff, KvContext, PublishKind};
use crate::metrics::Metrics;
use crate::request::{GenerationRequest, SeqEvents};
use crate::scheduler::EngineHandle;

/// The engine and what submitting to it needs.
pub struct ServingContext {
    /// Submits sequences to the scheduler thread.
    pub engine: EngineHandle,
    /// Tokenizer and chat template (the forward pass runs on the scheduler thread).
    pub model: Arc<Model>,
    /// Model facts used to validate requests.
    pub limits: ModelLimits,
    /// Engine metrics.
    pub metrics: Arc<Metrics>,
    /// KV handoff with peers: block format, transfer service.
    pub kv: KvContext,
}

impl ServingContext {
    /// Queues a validated request: 429 when the waiting queue is full.
    pub fn submit(&self, request: GenerationRequest) -> Result<SeqEvents, ApiError> {
        Ok(self.engine.submit(request)?)
    }

    /// Submits `request` and returns its output, cut at `stop` strings.
    pub fn generate(
        self: &Arc<Self>,
        request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        let prompt_tokens = request.prompt.len();
        let events = self.submit(request)?;
        Ok(Generation::new(self.clone(), events, prompt_tokens, stop))
    }

    /// Applies `params` to `request` (pulling a peer's KV where they say so), submits it,
    /// and returns its output, which publishes the finished request's blocks where
    /// `params` ask for that.
    pub async fn submit_with_kv(
        self: &Arc<Self>,
        params: Option<&KvTransferParams>,
        mut request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        let publish = handoff::prepare(&self.kv, params, &mut request).await?;
        // A prefill for a peer must end with its one token, never be cut by a stop string
        // (that cancels the sequence and its blocks with it).
        let stop = if publish.as_ref().map(|p| p.kind) == Some(PublishKind::Prefill) {
            Vec::new()
        } else {
            stop
        };
        Ok(self.generate(request, stop)?.publishing(publish))
    }
}
