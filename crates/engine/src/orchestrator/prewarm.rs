//! Pre-warm: one tiny request (prompt `" x"`, one token) through each prefill worker →
//! this worker pair, at start and whenever a prefill worker (re)appears, so the first
//! user request does not pay for connection and KV transfer set-up. A pair that went
//! through is warm: requests are routed to it and `/health` is 200 once one pair is.
//!
//! Each prefill worker has a supervisor: while the worker is cold it tries a pre-warm
//! every `--prewarm-interval-secs` (5), logging each failure, up to `--prewarm-attempts`
//! (60) times, then waits for the worker's `/health` to answer 200 before trying again.
//! While it is warm it probes `/health` at the same interval; a failed probe, or a
//! request that could not reach the worker, makes it cold again.

use std::sync::Arc;
use std::time::Duration;

use super::leg::prefill_body;
use super::{Orchestrator, PrefillWorker};
use crate::kv::import::import_prompt_kv;
use crate::kv::pull::RemoteBlocks;
use crate::request::{GenerationRequest, SeqEvent};
use crate::serving::ServingContext;

/// The pre-warm prompt.
pub const PREWARM_PROMPT: &str = " x";

/// Longest wait for a prefill worker's `/health`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Keeps `worker` warm for as long as the task runs (see the module docs).
pub async fn supervise(
    orchestrator: Arc<Orchestrator>,
    ctx: Arc<ServingContext>,
    worker: Arc<PrefillWorker>,
) {
    let prompt = match ctx.text.tokenizer().encode(PREWARM_PROMPT, true) {
        Ok(ids) if !ids.is_empty() => ids,
        other => {
            tracing::error!(
                "cannot tokenize the pre-warm prompt ({other:?}); {} is never pre-warmed",
                worker.url
            );
            return;
        }
    };
    let config = &orchestrator.config;
    let pool = &orchestrator.pool;
    loop {
        let mut attempt = 0;
        while !worker.is_warm() {
            attempt += 1;
            match warm_once(&orchestrator, &ctx, &worker, &prompt).await {
                Ok(()) => {
                    pool.mark_warm(&worker);
                    orchestrator.metrics.orchestrator.prewarm("ok");
                    tracing::info!(
                        prefill = %worker.url,
                        attempt,
                        warm = pool.warm_count(),
                        "pre-warmed the prefill worker -> this worker pair"
                    );
                }
                Err(why) => {
                    orchestrator.metrics.orchestrator.prewarm("failed");
                    tracing::warn!(
                        prefill = %worker.url,
                        "pre-warm attempt {attempt}/{} failed: {why}; retrying in {:?}",
                        config.prewarm_attempts,
                        config.prewarm_interval
                    );
                    if attempt >= config.prewarm_attempts {
                        tracing::warn!(
                            prefill = %worker.url,
                            "giving up pre-warming after {attempt} attempts; trying again \
                             when its /health answers 200"
                        );
                        wait_until_healthy(&orchestrator, &worker).await;
                        attempt = 0;
                        continue;
                    }
                    tokio::time::sleep(config.prewarm_interval).await;
                }
            }
        }
        // Warm: watch it until it goes away.
        loop {
            tokio::select! {
                _ = tokio::time::sleep(config.prewarm_interval) => {}
                _ = worker.went_cold.notified() => {}
            }
            if !worker.is_warm() {
                break;
            }
            if let Err(why) = orchestrator
                .client
                .healthy(&worker.url, PROBE_TIMEOUT)
                .await
            {
                pool.mark_cold(&worker);
                tracing::warn!(
                    prefill = %worker.url,
                    "prefill worker unhealthy ({why}); routing around it and pre-warming it again"
                );
                break;
            }
        }
    }
}

async fn wait_until_healthy(orchestrator: &Orchestrator, worker: &PrefillWorker) {
    while orchestrator
        .client
        .healthy(&worker.url, PROBE_TIMEOUT)
        .await
        .is_err()
    {
        tokio::time::sleep(orchestrator.config.prewarm_interval).await;
    }
}

/// One pre-warm request: the prefill leg on `worker`, then a one-token decode here with
/// its KV. Not counted as a user request anywhere.
async fn warm_once(
    orchestrator: &Orchestrator,
    ctx: &Arc<ServingContext>,
    worker: &PrefillWorker,
    prompt: &[u32],
) -> Result<(), String> {
    let body = prefill_body(None, prompt, None, None);
    let params = orchestrator
        .client
        .send(&worker.url, &body)
        .await
        .map_err(|e| e.to_string())?
        .kv_transfer_params;
    let mut request = GenerationRequest::new(prompt.to_vec(), 1);
    match &params {
        Some(params) if RemoteBlocks::named_by(params) => {
            if let Some(peer) = crate::kv::pull::KvPeer::from_params(params) {
                worker.set_kv_peer(peer);
            }
            import_prompt_kv(&ctx.kv, params, &mut request)
                .await
                .map_err(|e| e.to_string())?;
        }
        _ => tracing::warn!(
            prefill = %worker.url,
            "the pre-warm prefill answered without kv_transfer_params (it keeps no KV?)"
        ),
    }
    let mut events = ctx.submit(request).map_err(|e| e.to_string())?;
    loop {
        match events.recv().await {
            Some(SeqEvent::Finished { .. }) => return Ok(()),
            Some(SeqEvent::Failed(why)) => return Err(format!("the local decode failed: {why}")),
            Some(_) => {}
            None => return Err("the engine stopped".into()),
        }
    }
}
