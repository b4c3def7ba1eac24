//! The composition root: the resolved configuration turned into the components a
//! running gateway is made of (the fleet, the request path's [`Serving`], metrics, the
//! KV-event hub), each handed only its own settings and counters.

use std::sync::Arc;

use axum::extract::FromRef;

use crate::clients::worker_client::{ClientSettings, WorkerClient};
use crate::config::GatewayConfig;
use crate::error::GatewayError;
use crate::fleet::identity::{Instance, WorkerCheck};
use crate::fleet::kv_events::KvEventsHub;
use crate::fleet::registry::{Registry, WorkerSource};
use crate::ingress::admission::Admission;
use crate::ingress::prompt_tokens::PromptTokenizer;
use crate::observe::metrics::Metrics;
use crate::policy;
use crate::routes::admin::AdminApi;
use crate::serving::{LegSettings, Serving, ServingMetrics};
use crate::sessions::conversation::ConversationCache;

/// State shared by the server's routes and tasks. axum copies the router's state for
/// every request, so it is one `Arc` (a count, not a copy of each part); handlers take
/// only the part they name, through [`FromRef`].
#[derive(Debug, Clone)]
pub struct AppState(Arc<SharedState>);

impl std::ops::Deref for AppState {
    type Target = SharedState;

    fn deref(&self) -> &SharedState {
        &self.0
    }
}

/// What [`AppState`] holds.
#[derive(Debug)]
pub struct SharedState {
    /// The resolved configuration.
    pub config: Arc<GatewayConfig>,
    /// What generation requests share: the fleet, routing, client, sessions.
    pub serving: Arc<Serving>,
    /// Every component's metrics, exported at `/metrics`.
    pub metrics: Arc<Metrics>,
    /// This gateway process's identity (loop detection, refusing itself as a worker).
    pub instance: Arc<Instance>,
    /// The workers' KV-event subscriptions and block indexes.
    pub kv_events: Arc<KvEventsHub>,
    /// What `/instances` works with.
    pub admin: Arc<AdminApi>,
    /// How a worker URL is checked before it is routed to (discovery, static flags).
    pub worker_check: WorkerCheck,
    /// The P:D planner signal (`/planner`).
    pub planner: Arc<crate::planner::Planner>,
}

impl AppState {
    /// State for `config`, with its static workers registered.
    pub fn new(config: GatewayConfig) -> Result<Self, GatewayError> {
        let mut metrics = Metrics::default();
        let history = metrics.history.clone();
        let serving_metrics = Arc::new(ServingMetrics::register(metrics.registry_mut(), history));
        let predictor = Arc::new(crate::policy::predictor::LatencyPredictor::new());
        predictor.register(metrics.registry_mut());
        let planner = Arc::new(crate::planner::Planner::new(
            crate::planner::PlannerSettings::new(
                config.planner_interval,
                config.planner_window,
                config.slo,
            ),
        ));
        planner.register(metrics.unprefixed_mut());
        let metrics = Arc::new(metrics);
        let registry = Arc::new(Registry::new(metrics.fleet.clone(), config.health));
        for spec in config.static_workers() {
            registry
                .register_from(spec, WorkerSource::Static)
                .map_err(|e| GatewayError::Config(e.to_string()))?;
        }
        let kv_events = Arc::new(KvEventsHub::new(
            config.kv_events.clone(),
            metrics.kv_events.clone(),
        ));
        let build = |name: &str| {
            policy::build_with(name, &config.policy_config, &kv_events, &predictor)
                .ok_or_else(|| GatewayError::Config(format!("unknown routing policy `{name}`")))
        };
        let own =
            |role_policy: &Option<String>| build(role_policy.as_deref().unwrap_or(&config.policy));
        // Same order as `policy::role_index`: prefill, decode, prefill_decode, encode.
        let policies = [
            own(&config.prefill_policy)?,
            own(&config.decode_policy)?,
            build(&config.policy)?,
            build(&config.policy)?,
        ];
        let tokenizer = match &config.tokenizer {
            Some(path) => Some(Arc::new(PromptTokenizer::load(
                path,
                config.tokenizer_cache_bytes,
            )?)),
            None => None,
        };
        let routing_reads_tokens =
            config.disagg_threshold.is_some() || policies.iter().any(|p| p.reads_prompt());
        let admission = Admission::new(
            config.max_concurrent_requests,
            config.queue_size,
            config.queue_timeout,
            metrics.admission.clone(),
        );
        let serving = Serving {
            settings: leg_settings(&config),
            registry,
            policies,
            client: WorkerClient::new(ClientSettings {
                idle_timeout: config.upstream_idle_timeout,
                connect_timeout: config.connect_timeout,
                worker_api_key: config.worker_api_key.clone(),
            })?,
            conversations: Arc::new(ConversationCache::new(
                config.max_conversations,
                config.conversation_ttl,
            )),
            model_lens: Default::default(),
            tokenizer,
            routing_reads_tokens,
            admission,
            local_prefills: Default::default(),
            metrics: serving_metrics,
            history: pdserve_history::HistoryStore::open(config.history.clone())
                .map_err(|e| GatewayError::Config(e.to_string()))?,
            predictor,
        };
        let instance = Arc::new(Instance::new());
        let worker_check = WorkerCheck {
            client: serving.client.pooled().clone(),
            instance: (*instance).clone(),
            allow_gateways: config.allow_gateway_workers,
            timeout: config.probe.timeout,
        };
        let admin = Arc::new(AdminApi {
            registry: serving.registry.clone(),
            check: worker_check.clone(),
            admin_api_key: config.admin_api_key.clone(),
            kv_events: kv_events.clone(),
            fleet_metrics: metrics.fleet.clone(),
        });
        Ok(Self(Arc::new(SharedState {
            serving: Arc::new(serving),
            metrics,
            instance,
            kv_events,
            admin,
            worker_check,
            planner,
            config: Arc::new(config),
        })))
    }
}

/// The generation routes (and the dashboard, readiness) take only what requests share.
impl FromRef<AppState> for Arc<Serving> {
    fn from_ref(state: &AppState) -> Self {
        state.serving.clone()
    }
}

/// The admin API takes only its own part.
impl FromRef<AppState> for Arc<AdminApi> {
    fn from_ref(state: &AppState) -> Self {
        state.admin.clone()
    }
}

/// The health routes name this gateway.
impl FromRef<AppState> for Arc<Instance> {
    fn from_ref(state: &AppState) -> Self {
        state.instance.clone()
    }
}

/// The request path's settings out of the whole configuration.
fn leg_settings(config: &GatewayConfig) -> LegSettings {
    LegSettings {
        protocol: config.protocol,
        first_token_from_prefill: config.first_token_from_prefill,
        sglang_wait_prefill_head: config.sglang_wait_prefill_head,
        prefill_timeout: config.prefill_timeout,
        decode_timeout: config.decode_timeout,
        stream_idle_timeout: config.stream_idle_timeout,
        connect_timeout: config.connect_timeout,
        probe_timeout: config.probe.timeout,
        max_retries: config.max_retries,
        disagg_threshold: config.disagg_threshold,
        disagg_min_prefill_load: config.disagg_min_prefill_load,
        encoder_max_batch_size: config.encoder_max_batch_size,
        no_rewrite: config.no_rewrite,
        expose_routing: config.expose_routing,
        max_body_bytes: config.max_body_bytes,
        kv_secret: config.kv_secret.clone(),
        slo: config.slo,
        shed_priority: config.shed_priority,
    }
}
