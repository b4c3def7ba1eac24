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
//! - [`handoff`]: sequential (prefill answers, then the KV read) and concurrent (the KV
//!   read starts with the prefill and waits for its blocks) handoff.
//! - [`prewarm`]: one tiny request through each prefill → this worker pair at start and
//!   whenever a prefill worker (re)appears; `/health` is 503 until one pair is warm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use pdserve_protocol::{ApiError, KvTransferParams};
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::api::prepared::Prepared;
use crate::api::AppState;
use crate::kv::pull::KvPeer;
use crate::metrics::Metrics;

pub mod handoff;
pub mod leg;
pub mod metrics;
pub mod pool;
pub mod prewarm;

pub use leg::PrefillError;
pub use metrics::OrchestratorMetrics;
pub use pool::{PrefillPool, PrefillWorker};

/// The header that names a request's session (as with the gateway's `session` policy).
pub const SESSION_HEADER: &str = "x-session-id";

/// How the KV moves from the prefill worker to this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HandoffMode {
    /// The prefill worker answers with where its KV is; then this worker reads it.
    #[default]
    Sequential,
    /// This worker starts reading while the prefill runs: the read waits for the blocks,
    /// under an id this worker chose, and the prefill answer is raced against the decode.
    Concurrent,
}

/// What `--prefill` and its companion flags configure.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// Base URLs of the prefill workers (`http://host:port`, no trailing slash).
    pub prefill: Vec<String>,
    /// Sequential or concurrent handoff.
    pub handoff: HandoffMode,
    /// Longest wait for a prefill worker's answer.
    pub prefill_timeout: Duration,
    /// Time between pre-warm attempts, and between health probes of warm workers.
    pub prewarm_interval: Duration,
    /// Pre-warm attempts per appearance of a prefill worker before giving up (until its
    /// `/health` answers again).
    pub prewarm_attempts: u32,
    /// Bearer key sent to the prefill workers (this worker's own `--api-key`: `pdserve up
    /// --api-key` gives every worker the same one).
    pub prefill_api_key: Option<String>,
}

/// Checks a `--prefill` value and returns it without a trailing slash.
pub fn prefill_url(raw: &str) -> Result<String, String> {
    let url = raw.trim().trim_end_matches('/');
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "--prefill {raw:?}: expected http://host:port (workers speak plain HTTP)"
        ));
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(format!(
            "--prefill {raw:?}: expected http://host:port with no path"
        ));
    }
    Ok(url.to_string())
}

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

impl IntoResponse for OrchestrateError {
    fn into_response(self) -> Response {
        match self {
            Self::Api(e) => e.into_response(),
            Self::Prefill(e) => e.into_response(),
        }
    }
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
    pub fn spawn_prewarm(self: &Arc<Self>, app: &Arc<AppState>) -> Vec<JoinHandle<()>> {
        self.pool
            .workers()
            .iter()
            .map(|worker| {
                tokio::spawn(prewarm::supervise(
                    self.clone(),
                    app.clone(),
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
        app: &Arc<AppState>,
        prepared: Prepared,
        headers: &HeaderMap,
    ) -> Response {
        let session = session_key(headers, prepared.session.as_deref());
        let worker = self.pool.choose(session);
        let result = match (self.config.handoff, worker.kv_peer()) {
            (HandoffMode::Concurrent, Some(peer)) if worker.supports_awaited_reads() => {
                handoff::concurrent(self, app, &worker, peer, prepared).await
            }
            // Until a prefill worker has answered once, where its KV service is is
            // unknown, and a worker that ignores `publish_request_id` cannot be read
            // early at all.
            _ => handoff::sequential(self, app, &worker, prepared).await,
        };
        result.unwrap_or_else(IntoResponse::into_response)
    }

    /// Sends one prefill leg to `worker` and returns the `kv_transfer_params` it
    /// answered with. Counts the outcome, learns where the worker's KV service is, and
    /// marks the worker cold when it cannot be reached (its supervisor re-warms it).
    pub async fn prefill(
        &self,
        worker: &PrefillWorker,
        body: &Value,
    ) -> Result<Option<KvTransferParams>, PrefillError> {
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
            Ok(params) => {
                if let Some(peer) = params.as_ref().and_then(KvPeer::from_params) {
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

/// The session a request belongs to: the `X-Session-Id` header, else the body's
/// `conversation_id` or `user` (non-empty).
pub fn session_key<'a>(headers: &'a HeaderMap, body_key: Option<&'a str>) -> Option<&'a str> {
    headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .or(body_key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_urls_are_plain_http_bases() {
        assert_eq!(
            prefill_url("http://127.0.0.1:8100/").unwrap(),
            "http://127.0.0.1:8100"
        );
        assert_eq!(prefill_url("http://p:1").unwrap(), "http://p:1");
        for bad in ["127.0.0.1:8100", "https://p:1", "http://", "http://p:1/v1"] {
            assert!(prefill_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_header_names_the_session_before_the_body() {
        let mut headers = HeaderMap::new();
        assert_eq!(session_key(&headers, Some("body")), Some("body"));
        assert_eq!(session_key(&headers, None), None);
        headers.insert(SESSION_HEADER, "header".parse().unwrap());
        assert_eq!(session_key(&headers, Some("body")), Some("header"));
        headers.insert(SESSION_HEADER, "".parse().unwrap());
        assert_eq!(session_key(&headers, Some("body")), Some("body"));
    }
}
