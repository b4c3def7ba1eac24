//! State shared by every request: configuration, the live registry, the routing policy,
//! the upstream client, the conversation cache and metrics.

use std::sync::Arc;

use pdserve_protocol::WorkerRole;

use crate::args::GatewayConfig;
use crate::conversation::ConversationCache;
use crate::error::GatewayError;
use crate::metrics::Metrics;
use crate::policy::{self, Policy, RouteRequest};
use crate::registry::{InFlight, Registry, Worker};
use crate::upstream::{LegError, LegErrorKind, Upstream};

/// State shared by all requests.
#[derive(Debug)]
pub struct AppState {
    /// The resolved configuration.
    pub config: GatewayConfig,
    /// The live worker set.
    pub registry: Arc<Registry>,
    /// How workers are chosen.
    pub policy: Arc<dyn Policy>,
    /// The upstream HTTP client.
    pub upstream: Upstream,
    /// Decode KV handles kept for conversations' next turns.
    pub conversations: Arc<ConversationCache>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl AppState {
    /// State for `config`, with its static workers registered.
    pub fn new(config: GatewayConfig) -> Result<Self, GatewayError> {
        let metrics = Arc::new(Metrics::default());
        let registry = Arc::new(Registry::new(metrics.clone(), config.health));
        for spec in config.static_workers() {
            registry
                .register(spec)
                .map_err(|e| GatewayError::Config(e.to_string()))?;
        }
        let policy = policy::by_name(&config.policy).ok_or_else(|| {
            GatewayError::Config(format!("unknown routing policy `{}`", config.policy))
        })?;
        Ok(Self {
            upstream: Upstream::new(&config)?,
            conversations: Arc::new(ConversationCache::new(
                config.max_conversations,
                config.conversation_ttl,
            )),
            registry,
            policy,
            metrics,
            config,
        })
    }

    /// A live worker of `role` that this request has not tried yet, chosen by the policy.
    pub fn pick(
        &self,
        role: WorkerRole,
        tried: &[Arc<Worker>],
        route: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        let roster = self.registry.snapshot();
        let live = roster.live(role);
        if tried.is_empty() {
            return self.policy.select(role, live, route);
        }
        let untried: Vec<_> = live
            .iter()
            .filter(|w| !tried.iter().any(|t| t.base == w.base))
            .cloned()
            .collect();
        self.policy.select(role, &untried, route)
    }

    /// Marks a request as open on `worker` until the returned guard drops.
    pub fn start_request(&self, worker: Arc<Worker>) -> InFlight {
        InFlight::start(worker, self.policy.clone())
    }

    /// Passive health: a request that could not connect to `worker` evicts it at once;
    /// other transport failures count as one failed probe.
    pub fn report(&self, worker: &Arc<Worker>, error: &LegError) {
        match error.kind {
            LegErrorKind::Connect => {
                self.registry
                    .record_failure(worker, true, "a request could not connect")
            }
            LegErrorKind::Transport => {
                self.registry
                    .record_failure(worker, false, "a request's connection failed")
            }
            _ => {}
        }
    }
}
