//! The serving context: the engine and what every way of serving a request (the OpenAI
//! routes, SGLang's bootstrap rooms, the orchestrator) submits through.

use std::sync::Arc;

use pdserve_model::ModelText;
use pdserve_protocol::{ApiError, KvTransferParams};

use super::{Generation, ModelLimits};
use crate::kv::export::prepare_prefill;
use crate::kv::import::import_prompt_kv;
use crate::kv::{KvContext, Publish, PublishKind};
use crate::metrics::Metrics;
use crate::request::{GenerationRequest, SeqEvents};
use crate::scheduler::EngineHandle;
use crate::trace::GenerationTrace;

/// The engine and what submitting to it needs.
pub struct ServingContext {
    /// Submits sequences to the scheduler thread.
    pub engine: EngineHandle,
    /// Tokenizer and chat template (the forward pass runs on the scheduler thread).
    pub text: Arc<ModelText>,
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
        mut request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        let prompt_tokens = request.prompt.len();
        let model = &self.limits.served_model_name;
        let trace = GenerationTrace::start(model, request.max_new_tokens, &request.sampling);
        request.trace = trace.as_ref().map(GenerationTrace::instants);
        let events = self.submit(request)?;
        Ok(Generation::new(self.clone(), events, prompt_tokens, stop).traced(trace))
    }

    /// Submits a prefill whose KV a peer will read: pinned when it finishes and
    /// published (under the id `params` name, if any), its output never cut by a stop
    /// string (that would cancel the sequence and its blocks with it). The caller has
    /// checked that this worker has a KV transfer service.
    pub async fn submit_prefill_for_peer(
        self: &Arc<Self>,
        params: &KvTransferParams,
        mut request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        let Some(service) = &self.kv.service else {
            return self.generate(request, stop);
        };
        let name = prepare_prefill(&self.kv, service, params, &mut request).await?;
        let publish = Publish {
            kind: PublishKind::Prefill,
            name,
        };
        Ok(self
            .generate(request, Vec::new())?
            .publishing(Some(publish)))
    }

    /// Submits a request whose prompt KV a peer computed, imported first; with a KV
    /// transfer service the finished request's KV is kept for the conversation's next
    /// turn (its prefill reads it back).
    pub async fn submit_importing(
        self: &Arc<Self>,
        params: &KvTransferParams,
        mut request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        import_prompt_kv(&self.kv, params, &mut request).await?;
        request.pin_on_finish = self.kv.service.is_some();
        let publish = request
            .pin_on_finish
            .then(|| Publish::unnamed(PublishKind::Conversation));
        Ok(self.generate(request, stop)?.publishing(publish))
    }
}
