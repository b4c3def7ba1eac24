//! The one place a request's KV handoff is chosen and its choices submitted: computed
//! here, orchestrated (a prefill worker computes the prompt first), vLLM's
//! `kv_transfer_params` (prefill for a peer, or import a peer's KV), or SGLang's bootstrap
//! rooms (prefill side or decode side, by this worker's role).

use std::sync::Arc;

use pdserve_protocol::{ApiError, BootstrapParams, KvTransferParams, WorkerRole};

use crate::bootstrap::{self, Bootstrap};
use crate::kv::import::import_prompt_kv;
use crate::kv::HandoffError;
use crate::orchestrator::Orchestrator;
use crate::request::GenerationRequest;
use crate::serving::{choice_request, EchoPlan, Generation, ServingContext, Submitted};

/// How this worker serves one request's KV.
#[derive(Clone, Copy)]
pub enum Handoff<'r> {
    /// Nothing moves: the prompt is computed here.
    Local,
    /// This decode worker orchestrates: a prefill worker computes the prompt first.
    Orchestrated(&'r Arc<Orchestrator>),
    /// vLLM's `do_remote_decode`: compute the prompt and keep its KV for the peer that
    /// will read it.
    PrefillForPeer(&'r KvTransferParams),
    /// vLLM's `do_remote_prefill`: import the prompt's KV from the peer that computed it
    /// (a decode leg, or a prefill reading a conversation's earlier turns back).
    ImportFromPeer(&'r KvTransferParams),
    /// SGLang's bootstrap on a prefill worker: one room per choice, read by its decode
    /// worker.
    BootstrapPrefill(&'r [BootstrapParams]),
    /// SGLang's bootstrap on a decode worker: one room per choice to read.
    BootstrapDecode(&'r [BootstrapParams]),
}

impl<'r> Handoff<'r> {
    /// The handoff a request asks of this worker. The client's own handoff wins over
    /// orchestration; both of vLLM's and SGLang's at once is a 400, as is a
    /// `kv_transfer_params` that asks for both directions. An aggregated worker ignores
    /// bootstrap fields (as SGLang's does); a worker without a KV transfer service serves
    /// a `do_remote_decode` prefill in full.
    pub fn choose(
        serving: &ServingContext,
        role: WorkerRole,
        orchestrator: Option<&'r Arc<Orchestrator>>,
        kv_params: Option<&'r KvTransferParams>,
        bootstrap: &'r [BootstrapParams],
    ) -> Result<Self, ApiError> {
        match (kv_params, bootstrap.is_empty()) {
            (Some(_), false) => Err(ApiError::bad_request(
                "bootstrap_room and kv_transfer_params exclude each other (one handoff per request)",
            )
            .with_param("bootstrap_room")),
            (None, true) => Ok(orchestrator.map_or(Self::Local, Self::Orchestrated)),
            (None, false) => Ok(match role {
                WorkerRole::Prefill => Self::BootstrapPrefill(bootstrap),
                WorkerRole::Decode => Self::BootstrapDecode(bootstrap),
                _ => Self::Local,
            }),
            (Some(params), true) => match (params.do_remote_decode, params.do_remote_prefill) {
                (true, true) => Err(HandoffError::ConflictingDirections.into()),
                (true, false) if serving.kv.service.is_none() => {
                    tracing::warn!(
                        "do_remote_decode asked of a worker without a KV transfer service \
                         (start it with --kv-port); serving the request in full"
                    );
                    Ok(Self::Local)
                }
                (true, false) => Ok(Self::PrefillForPeer(params)),
                (false, true) => Ok(Self::ImportFromPeer(params)),
                // Nothing asked (e.g. a decode worker's hand-back echoed back as is).
                (false, false) => Ok(Self::Local),
            },
        }
    }

    /// Whether this worker computes the prompt itself (and so can score it).
    pub fn computes_prompt(self) -> bool {
        matches!(
            self,
            Self::Local | Self::PrefillForPeer(_) | Self::BootstrapPrefill(_)
        )
    }

    /// Submits choice `index` of a request served this way (not for
    /// [`Handoff::Orchestrated`], whose orchestrator submits its own).
    async fn submit_one(
        self,
        ctx: &Arc<ServingContext>,
        protocol: &Bootstrap,
        index: usize,
        request: GenerationRequest,
        stop: Vec<String>,
    ) -> Result<Generation, ApiError> {
        match self {
            Self::PrefillForPeer(params) => {
                ctx.submit_prefill_for_peer(params, request, stop).await
            }
            Self::ImportFromPeer(params) => ctx.submit_importing(params, request, stop).await,
            Self::BootstrapPrefill(rooms) => match rooms.get(index) {
                Some(room) => {
                    bootstrap::prefill::submit(ctx, protocol, room.bootstrap_room, request, stop)
                        .await
                }
                None => ctx.generate(request, stop),
            },
            Self::BootstrapDecode(rooms) => match rooms.get(index) {
                Some(room) => bootstrap::decode::submit(ctx, protocol, room, request, stop).await,
                None => ctx.generate(request, stop),
            },
            Self::Local | Self::Orchestrated(_) => ctx.generate(request, stop),
        }
    }

    /// Submits the `choices` choices of `request`. Where this worker computes the prompt
    /// itself, choice 0 goes first and the others follow once it has produced a token:
    /// its prompt blocks are then in the prefix cache and the other choices reuse them
    /// instead of computing the prompt again. A decode worker importing each choice's
    /// room submits them all at once. On an error the choices already submitted are
    /// dropped, which cancels them, unpins what they held and closes their rooms.
    ///
    /// With vLLM's `kv_transfer_params` and `n` > 1 (the gateway sends `n` to both legs):
    /// a remote-decode prefill runs once and publishes one KV handle, its output
    /// answering for every choice; a remote-prefill decode imports the peer's KV once,
    /// into choice 0, and the other choices reuse those blocks through the prefix cache.
    pub async fn submit(
        self,
        ctx: &Arc<ServingContext>,
        protocol: &Bootstrap,
        request: GenerationRequest,
        stop: Vec<String>,
        choices: usize,
        echo: Option<&EchoPlan>,
    ) -> Result<Submitted, ApiError> {
        // Echoing from the start: a primed generation's first piece is then its prompt.
        let echoing = |generation: Generation| match echo {
            Some(plan) => generation.echoing(plan.clone()),
            None => generation,
        };
        let one = |i: usize, handoff: Self| {
            let submitted =
                handoff.submit_one(ctx, protocol, i, choice_request(&request, i), stop.clone());
            async move { submitted.await.map(echoing) }
        };
        if choices == 1 {
            return Ok(Submitted::each(vec![one(0, self).await?]));
        }
        let (first, rest) = match self {
            // A prefill for a peer: one sequence, one published handle.
            Self::PrefillForPeer(_) => return Ok(Submitted::shared(one(0, self).await?, choices)),
            Self::BootstrapDecode(_) => (None, self),
            Self::ImportFromPeer(params) => {
                // Imported once, into choice 0. No conversation KV is kept for a next
                // turn (which choice would it continue?).
                let mut request = choice_request(&request, 0);
                import_prompt_kv(&ctx.kv, params, &mut request).await?;
                (
                    Some(echoing(ctx.generate(request, stop.clone())?)),
                    Self::Local,
                )
            }
            Self::Local | Self::Orchestrated(_) | Self::BootstrapPrefill(_) => {
                (Some(one(0, self).await?), self)
            }
        };
        let first = match first {
            Some(mut generation) => {
                if let Some(e) = generation.prime().await {
                    return Err(e);
                }
                Some(generation)
            }
            None => None,
        };
        let start = first.is_some() as usize;
        let others = futures::future::try_join_all((start..choices).map(|i| one(i, rest))).await?;
        Ok(Submitted::each(first.into_iter().chain(others).collect()))
    }
}
