//! Moving an orchestrated request's prompt KV from the prefill worker to this one, then
//! decoding here.
//!
//! - Sequential: the prefill leg answers with where its KV is; this worker reads it and
//!   decodes.
//! - Concurrent: this worker picks the publication's id, sends the prefill leg and, at
//!   the same time, starts a read that waits for the prefill worker to publish under
//!   that id. The prefill leg runs as its own task; every step of the decode is raced
//!   against it, so a failed prefill reaches the client as its error (a JSON error
//!   before the first chunk, an error event after it), never as a stream that hangs on
//!   KV that will not come or that ends as if nothing happened. The task is always
//!   awaited or aborted (dropping the request aborts it), never left behind.
//!
//! Either way the decode imports every prompt position but the last and computes that
//! one itself, so greedy output is token for token the aggregated worker's; or, when the
//! prefill leg answered the first token's id ([`super::first_token`]), it imports the
//! whole prompt and starts from that token. With `n` > 1 the prompt is prefilled and
//! read once; choice 0 imports it (and takes the first token) and the others reuse its
//! blocks here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pdserve_protocol::{ApiError, KvTransferParams};
use tokio::task::{JoinError, JoinHandle};

use super::first_token;
use super::leg::prefill_body;
use super::{
    OrchestrateError, OrchestratedRequest, Orchestrator, PrefillAnswer, PrefillError, PrefillWorker,
};
use crate::kv::import::{import_prompt_kv, use_pulled_prompt_kv};
use crate::kv::pull::{pull_blocks, KvPeer, RemoteBlocks};
use crate::kv::HandoffError;
use crate::request::GenerationRequest;
use crate::serving::{
    choice_request, Companion, EchoPlan, Generation, PromptScores, ServingContext, Submitted,
};

/// Prefill leg, then the KV read, then the decode.
pub async fn sequential(
    orchestrator: &Orchestrator,
    ctx: &Arc<ServingContext>,
    worker: &PrefillWorker,
    orchestrated: OrchestratedRequest,
) -> Result<Submitted, OrchestrateError> {
    let OrchestratedRequest {
        mut request,
        stop,
        model,
        prime,
        choices,
        echo,
        first_token_from_prefill: choice,
        ..
    } = orchestrated;
    let scored = request.prompt_logprobs.take();
    let mut body = prefill_body(model.as_deref(), &request.prompt, None, scored);
    let first = orchestrator.wants_first_token(ctx, choice, &request, scored);
    if first {
        first_token::ask(&mut body, &request);
    }
    let answer = orchestrator.prefill(worker, &body).await?;
    if first {
        request.first_token = orchestrator.first_token(ctx, worker, &answer, &request);
    }
    let echo = echo.map(|mut plan| {
        plan.scores = match answer.prompt_logprobs {
            Some(scores) => PromptScores::Given(scores),
            None => PromptScores::Unscored,
        };
        plan
    });
    let params = answer.kv_transfer_params;
    match params.as_ref().filter(|p| RemoteBlocks::named_by(p)) {
        Some(params) => import_prompt_kv(&ctx.kv, params, &mut request).await?,
        // The given first token, if any, then comes after the prompt computed here.
        None => tracing::warn!(
            prefill = %worker.url,
            "the prefill worker answered without kv_transfer_params (it keeps no KV?); \
             computing the prompt here"
        ),
    }
    Ok(decode(ctx, request, stop, prime, None, choices, echo).await?)
}

/// The KV read starts with the prefill leg and waits for its blocks.
pub async fn concurrent(
    orchestrator: &Arc<Orchestrator>,
    ctx: &Arc<ServingContext>,
    worker: &Arc<PrefillWorker>,
    peer: KvPeer,
    orchestrated: OrchestratedRequest,
) -> Result<Submitted, OrchestrateError> {
    let OrchestratedRequest {
        mut request,
        stop,
        model,
        prime,
        choices,
        echo,
        first_token_from_prefill: choice,
        ..
    } = orchestrated;
    // Never scored here (the orchestrator sends scored prompts the sequential way).
    request.prompt_logprobs = None;
    let echo = echo.map(|mut plan| {
        plan.scores = PromptScores::Unscored;
        plan
    });
    let id = format!("pdkv-{}", uuid::Uuid::new_v4().simple());
    let mut body = prefill_body(model.as_deref(), &request.prompt, Some(&id), None);
    let first = orchestrator.wants_first_token(ctx, choice, &request, None);
    if first {
        first_token::ask(&mut body, &request);
    }
    let mut prefill = {
        let (orchestrator, worker) = (orchestrator.clone(), worker.clone());
        // The leg's span goes under this request's, though it runs on a task of its own.
        AbortOnDrop(tokio::spawn(pdserve_telemetry::in_current_context(
            async move { orchestrator.prefill(&worker, &body).await },
        )))
    };
    let remote = RemoteBlocks::awaited(&peer, id.clone(), request.prompt.len(), &ctx.kv.layout);
    let fallback = Fallback {
        orchestrator,
        ctx,
        worker,
        id: &id,
    };
    let (pulled, mut answered) = {
        let read = pull_blocks(&ctx.kv, remote, &request.prompt);
        tokio::pin!(read);
        tokio::select! {
            // A failed prefill wins the race: dropping the read closes its connection.
            joined = &mut prefill => {
                let answer = prefill_result(joined)?;
                let params = answer.kv_transfer_params.clone();
                let pulled = if fallback.published_elsewhere(params.as_ref()) {
                    // It published under an id of its own: the early read would only wait
                    // for nothing.
                    let why = HandoffError::BadPublishId("ignored by the prefill worker".into());
                    fallback.read(params, &request, why).await?
                } else {
                    match read.await {
                        Ok(pulled) => pulled,
                        Err(e) => fallback.read(params, &request, e).await?,
                    }
                };
                (pulled, Some(answer))
            }
            pulled = &mut read => match pulled {
                Ok(pulled) => (pulled, None),
                Err(e) => {
                    let answer = prefill_result(prefill.await_result().await)?;
                    let params = answer.kv_transfer_params.clone();
                    (fallback.read(params, &request, e).await?, Some(answer))
                }
            },
        }
    };
    if first {
        if answered.is_none() {
            // The blocks are here; the answer with the token follows them at once (the
            // prefill worker answers as the same step ends).
            answered = Some(prefill_result(prefill.await_result().await)?);
        }
        if let Some(answer) = &answered {
            request.first_token = orchestrator.first_token(ctx, worker, answer, &request);
        }
    }
    let prefill_pending = answered.is_none();
    use_pulled_prompt_kv(&ctx.kv, pulled, &mut request)?;
    // The blocks are here, but the prefill worker has not answered yet: the output
    // stands only if it answers with success.
    let companion: Option<Companion> = prefill_pending.then(|| {
        Box::pin(async move {
            prefill_result(prefill.await_result().await)
                .map(drop)
                .map_err(ApiError::from)
        }) as Companion
    });
    Ok(decode(ctx, request, stop, prime, companion, choices, echo).await?)
}

/// Reading the KV by the prefill's answer when the early read failed.
struct Fallback<'a> {
    orchestrator: &'a Orchestrator,
    ctx: &'a Arc<ServingContext>,
    worker: &'a PrefillWorker,
    /// The id the early read waited for.
    id: &'a str,
}

impl Fallback<'_> {
    /// Whether the prefill's answer names a publication under another id than ours.
    fn published_elsewhere(&self, params: Option<&KvTransferParams>) -> bool {
        params.is_some_and(|p| {
            RemoteBlocks::named_by(p) && p.remote_request_id.as_deref() != Some(self.id)
        })
    }

    /// After a failed awaited read whose prefill answered with success: reads the blocks
    /// by the params it returned (a prefill worker that does not know
    /// `publish_request_id` published under an id of its own; a restarted one has a new
    /// engine id).
    async fn read(
        &self,
        params: Option<KvTransferParams>,
        request: &GenerationRequest,
        awaited_error: HandoffError,
    ) -> Result<pdserve_kv_transfer::PulledBlocks, HandoffError> {
        let Some(params) = params.filter(RemoteBlocks::named_by) else {
            return Err(awaited_error);
        };
        tracing::info!(
            prefill = %self.worker.url,
            "the concurrent KV read failed ({awaited_error}); reading by the prefill's answer"
        );
        self.orchestrator
            .metrics
            .orchestrator
            .concurrent_fallbacks
            .inc();
        if params.remote_request_id.as_deref() != Some(self.id) {
            self.worker.ignores_publish_request_id();
        }
        let remote = RemoteBlocks::from_params(&params, &self.ctx.kv.layout)?;
        pull_blocks(&self.ctx.kv, remote, &request.prompt).await
    }
}

fn prefill_result(
    joined: Result<Result<PrefillAnswer, PrefillError>, JoinError>,
) -> Result<PrefillAnswer, OrchestrateError> {
    match joined {
        Ok(result) => Ok(result?),
        Err(e) => Err(ApiError::internal(format!("the prefill leg's task failed: {e}")).into()),
    }
}

impl From<OrchestrateError> for ApiError {
    fn from(e: OrchestrateError) -> Self {
        match e {
            OrchestrateError::Api(e) => e,
            OrchestrateError::Prefill(e) => e.into(),
        }
    }
}

/// Submits `request` here (its `choices` choices) and returns their output. With
/// `prime` (a stream) or several choices the first piece is awaited first, so an error
/// before any output (a failed prefill leg included) is answered with its own status.
/// The imported KV goes into choice 0 only, which runs first; the other choices take its
/// blocks from the prefix cache (the prefill leg, one sequence, does not carry `n`).
async fn decode(
    ctx: &Arc<ServingContext>,
    mut request: GenerationRequest,
    stop: Vec<String>,
    prime: bool,
    companion: Option<Companion>,
    choices: usize,
    echo: Option<EchoPlan>,
) -> Result<Submitted, ApiError> {
    let import = request.kv_import.take();
    let mut first = choice_request(&request, 0);
    first.kv_import = import;
    // Echoing before priming: the prompt piece is the answer's first.
    let echoing = |generation: Generation| match &echo {
        Some(plan) => generation.echoing(plan.clone()),
        None => generation,
    };
    let mut generation = echoing(ctx.generate(first, stop.clone())?);
    if let Some(companion) = companion {
        generation = generation.with_companion(companion);
    }
    if prime || choices > 1 {
        if let Some(e) = generation.prime().await {
            return Err(e);
        }
    }
    let rest = (1..choices)
        .map(|i| {
            ctx.generate(choice_request(&request, i), stop.clone())
                .map(echoing)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let generations = std::iter::once(generation).chain(rest).collect();
    Ok(Submitted::each(generations))
}

/// A task that is aborted when its handle is dropped (a client that goes away takes
/// the prefill leg with it).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Waits for the task's result.
    async fn await_result(&mut self) -> Result<T, JoinError> {
        (&mut self.0).await
    }
}

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
