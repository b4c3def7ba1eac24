//! Decode as orchestrator: with `--prefill URL…` a decode worker is the entry point of
//! P/D serving, with no gateway in front. Its chat and completions routes tokenize the
//! prompt once, send it as token ids to a prefill worker (one token, not streamed,
//! `kv_transfer_params.do_remote_decode`), then decode on this worker with the KV the
//! prefill worker kept. One network hop and one JSON round-trip fewer than through a
//! gateway, and nobody tokenizes the prompt twice.
//!
//! - [`pool`]: the prefill workers, which are warm, and which one a request goes to
//!   (round-robin, or rendezvous hashing on a session key).
//! - [`leg`]: the prefill leg over HTTP and how it fails.
//! - [`first_token`]: the prefill leg's own first token, which the decode starts from.
//! - [`handoff`]: sequential (prefill answers, then the KV read) and concurrent (the KV
//!   read starts with the prefill and waits for its blocks) handoff.
//! - [`prewarm`]: one tiny request through each prefill → this worker pair at start and
//!   whenever a prefill worker (re)appears; `/health` is 503 until one pair is warm.

use std::sync::Arc;
use std::time::Instant;

use pdserve_protocol::ApiError;
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::kv::pull::KvPeer;
use crate::metrics::Metrics;
use crate::request::GenerationRequest;
use crate::serving::{EchoPlan, ServingContext, Submitted};

pub mod config;
pub mod first_token;
pub mod handoff;
pub mod leg;
pub mod pool;
pub mod prewarm;

pub use config::{prefill_url, FirstTokenFromPrefill, HandoffMode, OrchestratorConfig};
pub use leg::{PrefillAnswer, PrefillError};
pub use pool::{PrefillPool, PrefillWorker};

/// A decode worker's orchestration of prefill workers.
#[derive(Debug)]
pub struct Orchestrator {
    config: OrchestratorConfig,
    pool: Arc<PrefillPool>,
    client: leg::PrefillClient,
    metrics: Arc<Metrics>,
}

/// Why an orchestrated request failed before its answer started.
#[derive(Debug)]
pub enum OrchestrateError {
    /// This worker refused or failed it.
    Api(ApiError),
    /// The prefill leg failed.
    Prefill(PrefillError),
}

impl From<ApiError> for OrchestrateError {
    fn from(e: ApiError) -> Self {
        Self::Api(e)
    }
}

impl From<PrefillError> for OrchestrateError {
    fn from(e: PrefillError) -> Self {
        Self::Prefill(e)
    }
}

impl From<crate::kv::HandoffError> for OrchestrateError {
    fn from(e: crate::kv::HandoffError) -> Self {
        Self::Api(e.into())
    }
}

/// A request the orchestrator serves: its prompt as token ids and how to run its
/// choices.
pub struct OrchestratedRequest {
    /// What the scheduler runs: prompt token ids, sampling, limits.
    pub request: GenerationRequest,
    /// Stop strings, applied to the output text.
    pub stop: Vec<String>,
    /// The client's `model` field, passed to the prefill worker.
    pub model: Option<String>,
    /// How many choices (`n`) to generate.
    pub choices: usize,
    /// The request's session key: its prefill worker is the session's owner.
    pub session: Option<String>,
    /// Wait for choice 0's first piece before returning, so that an error before any
    /// output can still be answered on its own (a stream decides JSON vs SSE on it).
    pub prime: bool,
    /// What the answer reports of the prompt; prompt scores are computed by the
    /// prefill worker.
    pub echo: Option<EchoPlan>,
    /// The request's own `first_token_from_prefill` field, when it has one.
    pub first_token_from_prefill: Option<bool>,
}

impl Orchestrator {
    /// An orchestrator over `config.prefill`; nothing is warm until
    /// [`Orchestrator::spawn_prewarm`] runs.
    pub fn new(config: OrchestratorConfig, metrics: Arc<Metrics>) -> Result<Self, String> {
        if config.prefill.is_empty() {
            return Err("an orchestrator needs at least one prefill worker".into());
        }
        let pool = Arc::new(PrefillPool::new(&config.prefill, metrics.clone()));
        let client =
            leg::PrefillClient::new(config.prefill_timeout, config.prefill_api_key.clone())?;
        Ok(Self {
            config,
            pool,
            client,
            metrics,
        })
    }

    /// The prefill workers.
    pub fn pool(&self) -> &Arc<PrefillPool> {
        &self.pool
    }

    /// The handoff this orchestrator runs.
    pub fn handoff(&self) -> HandoffMode {
        self.config.handoff
    }

    /// Starts pre-warming (and then watching) every prefill worker; the tasks run until
    /// aborted.
    pub fn spawn_prewarm(self: &Arc<Self>, ctx: &Arc<ServingContext>) -> Vec<JoinHandle<()>> {
        self.pool
            .workers()
            .iter()
            .map(|worker| {
                tokio::spawn(prewarm::supervise(
                    self.clone(),
                    ctx.clone(),
                    worker.clone(),
                ))
            })
            .collect()
    }

    /// Serves one chat or completion request: prefill leg on a prefill worker chosen for
    /// it, then decode here. Errors before the answer starts come back with their own
    /// status (a prefill worker's 4xx unchanged, its other failures as 502/504).
    pub async fn serve(
        self: &Arc<Self>,
        ctx: &Arc<ServingContext>,
        request: OrchestratedRequest,
    ) -> Result<Submitted, OrchestrateError> {
        let worker = self.pool.choose(request.session.as_deref());
        // Prompt scores come with the prefill's answer, which the sequential handoff
        // waits for anyway.
        let scored = request.request.prompt_logprobs.is_some();
        match (self.config.handoff, worker.kv_peer()) {
            (HandoffMode::Concurrent, Some(peer)) if worker.supports_awaited_reads() && !scored => {
                handoff::concurrent(self, ctx, &worker, peer, request).await
            }
            // Until a prefill worker has answered once, where its KV service is is
            // unknown, and a worker that ignores `publish_request_id` cannot be read
            // early at all.
            _ => handoff::sequential(self, ctx, &worker, request).await,
        }
    }

    /// Whether `request` (whose own field says `choice`; `scored` when its prompt is)
    /// asks its prefill leg for the first token.
    pub fn wants_first_token(
        &self,
        ctx: &ServingContext,
        choice: Option<bool>,
        request: &GenerationRequest,
        scored: Option<usize>,
    ) -> bool {
        scored.is_none()
            && first_token::wanted(
                self.config.first_token_from_prefill,
                choice,
                request,
                ctx.limits.max_model_len,
            )
    }

    /// The first token `answer` gives `request` to start from, counted by what became of
    /// it; `None` (this worker samples it again) when the answer has none or one that
    /// cannot start the decode.
    pub fn first_token(
        &self,
        ctx: &ServingContext,
        worker: &PrefillWorker,
        answer: &PrefillAnswer,
        request: &GenerationRequest,
    ) -> Option<u32> {
        let metrics = &self.metrics.orchestrator;
        let Some(token) = answer.first_token else {
            metrics.first_token("missing");
            if self.config.first_token_from_prefill == FirstTokenFromPrefill::On {
                tracing::warn!(
                    prefill = %worker.url,
                    "the prefill answer lists no token_ids (return_token_ids); \
                     sampling the first token here"
                );
            }
            return None;
        };
        if first_token::usable(token, request, ctx.limits.vocab_size) {
            metrics.first_token("used");
            Some(token)
        } else {
            metrics.first_token("unusable");
            None
        }
    }

    /// Sends one prefill leg to `worker` and returns what it answered (its
    /// `kv_transfer_params`, the prompt's scores if asked). Counts the outcome, learns where the worker's KV service is, and
    /// marks the worker cold when it cannot be reached (its supervisor re-warms it).
    pub async fn prefill(
        &self,
        worker: &PrefillWorker,
        body: &Value,
    ) -> Result<PrefillAnswer, PrefillError> {
        let started = Instant::now();
        let result = self.client.send(&worker.url, body).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(e) => e.outcome(),
        };
        self.metrics
            .orchestrator
            .observe_prefill(&worker.url, outcome, started.elapsed());
        match &result {
            Ok(answer) => {
                let params = answer.kv_transfer_params.as_ref();
                if let Some(peer) = params.and_then(KvPeer::from_params) {
                    worker.set_kv_peer(peer);
                }
            }
            Err(e) if e.worker_gone() => {
                tracing::warn!(prefill = %worker.url, "{e}; routing around it until it is warm again");
                self.pool.mark_cold(worker);
            }
            Err(e) => tracing::warn!(prefill = %worker.url, "{e}"),
        }
        result
    }
}
