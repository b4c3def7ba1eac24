//! What a request's handoff modes, legs, encoder stage and Responses route share: the
//! fleet and the routing over it, the client for workers, the conversations and stored
//! responses, their settings and their counters. Built by the composition root
//! (`crate::state`); nothing here reads the flags.

pub mod metrics;
pub mod outlook;
pub mod settings;

use crate::policy::predictor::{features_of, LatencyPredictor};
use std::sync::Arc;

use pdserve_protocol::{ApiError, WorkerRole};

use crate::clients::model_len::ModelLens;
use crate::clients::worker_client::{LegError, LegFault, WorkerClient};
use crate::fleet::registry::{CircuitState, Registry, Worker};
use crate::ingress::admission::Admission;
use crate::ingress::prompt_tokens::PromptTokenizer;
use crate::policy::{Choice, InFlight, Policy, RouteRequest};
use crate::sessions::conversation::ConversationCache;

pub use metrics::ServingMetrics;
pub use settings::{FirstTokenFromPrefill, LegSettings, Protocol};

/// State shared by every generation request.
#[derive(Debug)]
pub struct Serving {
    /// The request path's settings.
    pub settings: LegSettings,
    /// The live worker set.
    pub registry: Arc<Registry>,
    /// How workers of each role are chosen (indexed by `policy::role_index`).
    pub(crate) policies: [Arc<dyn Policy>; 4],
    /// The HTTP client for workers.
    pub client: WorkerClient,
    /// Decode KV handles kept for conversations' next turns.
    pub conversations: Arc<ConversationCache>,
    /// The workers' context lengths, for the length check before prefill.
    pub model_lens: ModelLens,
    /// The served model's tokenizer, with `--tokenizer`.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    /// Whether routing reads every prompt's token ids (a policy that matches prompts,
    /// or `--disagg-threshold`); else prompts are counted only where the context-length
    /// check could need it.
    pub routing_reads_tokens: bool,
    /// Overload control (`--max-concurrent-requests`).
    pub admission: Arc<Admission>,
    /// Prompts a decode worker is prefilling itself (`--disagg-threshold`), until its
    /// answer starts.
    pub local_prefills: Arc<std::sync::atomic::AtomicUsize>,
    /// The request path's counters (and the dashboard's history finished requests are
    /// filed into).
    pub metrics: Arc<ServingMetrics>,
    /// Stored responses and conversations (`--history-backend`).
    pub history: pdserve_history::HistoryStore,
    /// TTFT and TPOT predictions per role, learned from finished requests.
    pub predictor: Arc<LatencyPredictor>,
}

impl Serving {
    /// A live worker of `role` that this request has not tried yet and whose circuit
    /// admits it, chosen by the policy. Panic routing, rather than refusing: while no
    /// worker of `role` is live, an evicted one (see [`crate::fleet::registry::Routable`]);
    /// while every live one's breaker is open, one of those. `None` only when every
    /// routable worker was tried or none is routable (none registered, or all draining).
    pub fn pick(
        &self,
        role: WorkerRole,
        tried: &[Arc<Worker>],
        route: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>> {
        let roster = self.registry.snapshot();
        let routable = roster.routable(role);
        let live = routable.workers;
        if routable.panic && !live.iter().all(|w| tried.iter().any(|t| t.base == w.base)) {
            self.registry.note_panic(role, 1, "all are evicted");
        }
        let policy = self.policy(role);
        let began = route.trace.map(|_| std::time::Instant::now());
        // The common case allocates nothing: a first attempt with every circuit closed.
        if tried.is_empty() && live.iter().all(|w| w.circuit() == CircuitState::Closed) {
            let choice = self.decide(policy.as_ref(), role, live, route)?;
            log_choice(policy.name(), role, &choice.worker, live.len());
            if let (Some(cx), Some(began)) = (route.trace, began) {
                let name = policy.name();
                crate::observe::trace::routing(cx, began, name, role, &choice, live.len());
            }
            return Some(choice.worker);
        }
        let mut passed_over: Vec<&str> = tried.iter().map(|w| w.base.as_str()).collect();
        loop {
            let candidates: Vec<_> = live
                .iter()
                .filter(|w| !passed_over.contains(&w.base.as_str()) && w.breaker.is_candidate())
                .cloned()
                .collect();
            if candidates.is_empty() {
                break;
            }
            let choice = self.decide(policy.as_ref(), role, &candidates, route)?;
            // An open circuit past its cooldown admits one trial request; if another
            // request claimed it first, choose again without this worker.
            if choice.worker.breaker.admit() {
                log_choice(policy.name(), role, &choice.worker, candidates.len());
                if let (Some(cx), Some(began)) = (route.trace, began) {
                    let (name, n) = (policy.name(), candidates.len());
                    crate::observe::trace::routing(cx, began, name, role, &choice, n);
                }
                return Some(choice.worker);
            }
            let base = live.iter().find(|w| w.base == choice.worker.base)?;
            passed_over.push(base.base.as_str());
        }
        // Every untried worker is kept out by its breaker (open within its cooldown, or
        // its trial already on the way). Trying beats refusing, as for evicted workers:
        // a worker that recovered serves at once, and the outcome closes or reopens it.
        let untried: Vec<_> = live
            .iter()
            .filter(|w| !tried.iter().any(|t| t.base == w.base))
            .cloned()
            .collect();
        if untried.is_empty() {
            return None;
        }
        self.registry
            .note_panic(role, 1, "every one's circuit breaker is open");
        let choice = self.decide(policy.as_ref(), role, &untried, route)?;
        // Claims the trial when none is on its way, so its outcome decides the circuit.
        choice.worker.breaker.admit();
        log_choice(policy.name(), role, &choice.worker, untried.len());
        if let (Some(cx), Some(began)) = (route.trace, began) {
            let (name, n) = (policy.name(), untried.len());
            crate::observe::trace::routing(cx, began, name, role, &choice, n);
        }
        Some(choice.worker)
    }

    /// The policy's choice among `candidates`, its time recorded in
    /// `routing_decision_seconds`.
    fn decide(
        &self,
        policy: &dyn Policy,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        route: &RouteRequest<'_>,
    ) -> Option<Choice> {
        let began = std::time::Instant::now();
        let choice = choose(policy, role, candidates, route, &self.predictor);
        self.metrics
            .observe_routing_decision(role, policy.name(), began.elapsed());
        choice
    }

    /// A worker for a request any worker can answer (`/v1/models`, `/tokenize`): decode,
    /// else `prefill_decode`, else prefill ([`Self::refuse_any`] when there is none).
    pub fn pick_any(&self, route: &RouteRequest<'_>) -> Option<Arc<Worker>> {
        ANY_ROLE
            .into_iter()
            .find_map(|role| self.pick(role, &[], route))
    }

    /// The 503 when [`Self::pick_any`] found no worker.
    pub fn refuse_any(&self) -> ApiError {
        self.registry.refuse_any(&ANY_ROLE)
    }

    /// The 503 for a request that no worker of `role` can take (see [`Self::pick`]),
    /// naming the state that kept them out and counted in `refused_total`.
    pub fn refuse(&self, role: WorkerRole) -> ApiError {
        self.registry.refuse(role)
    }

    /// The policy that chooses workers of `role`.
    pub fn policy(&self, role: WorkerRole) -> &Arc<dyn Policy> {
        &self.policies[crate::policy::role_index(role)]
    }

    /// Marks a request as open on `worker` until the returned guard drops.
    pub fn start_request(&self, worker: Arc<Worker>) -> InFlight {
        let policy = self.policy(worker.role()).clone();
        InFlight::start(worker, policy)
    }

    /// A leg with prompt `tokens` that `worker` refused (a 4xx) or never got (no
    /// connection) left nothing in its cache: the policy that chose it forgets the
    /// prompt as sent there, or for `PENDING_FOR` it would count as cached on a worker
    /// that never computed it.
    pub fn forget_unsent(&self, worker: &Worker, tokens: Option<&[u32]>, error: &LegError) {
        let never_computed = matches!(error.kind, LegFault::Rejected | LegFault::Unreachable);
        if let (true, Some(tokens)) = (never_computed, tokens) {
            self.policy(worker.role()).forget_sent(worker, tokens);
        }
    }

    /// Passive health: a request that could not connect to `worker` evicts it at once;
    /// other transport failures count as one failed probe.
    pub fn report(&self, worker: &Arc<Worker>, error: &LegError) {
        match error.kind {
            LegFault::Unreachable => {
                self.registry
                    .record_failure(worker, true, "a request could not connect")
            }
            LegFault::Broken => {
                self.registry
                    .record_failure(worker, false, "a request's connection failed")
            }
            _ => {}
        }
    }
}

/// The roles that can answer a request any worker can answer, in the order tried.
const ANY_ROLE: [WorkerRole; 3] = [
    WorkerRole::Decode,
    WorkerRole::PrefillDecode,
    WorkerRole::Prefill,
];

/// The policy's choice, its cache match and prediction noted for the response headers
/// where the request keeps notes (`--expose-routing`) and, with the worker's load, for
/// the latency predictor; the match is looked for only then and for a traced request
/// (its `routing` span shows it).
fn choose(
    policy: &dyn Policy,
    role: WorkerRole,
    candidates: &[Arc<Worker>],
    route: &RouteRequest<'_>,
    predictor: &LatencyPredictor,
) -> Option<Choice> {
    let bare = |worker: Arc<Worker>| Choice {
        worker,
        cache: None,
        forecast: None,
    };
    if let Some(prefer) = route.prefer {
        if let Some(worker) = candidates.iter().find(|w| w.base == prefer) {
            return Some(bare(worker.clone()));
        }
    }
    let learns = route.seen.is_some() && route.tokens.is_some();
    if route.notes.is_none() && route.trace.is_none() && !learns {
        return policy.select(role, candidates, route).map(bare);
    }
    let choice = policy.choose(role, candidates, route)?;
    if let Some(notes) = route.notes {
        if let Some(cache) = choice.cache {
            notes.record(&choice.worker, cache);
        }
        if let Some(forecast) = choice.forecast {
            notes.record_forecast(&choice.worker, forecast);
        }
    }
    // The predictor learns from choices whose cache match is known in tokens.
    if let (Some(seen), Some(tokens), Some(cache)) = (route.seen, route.tokens, choice.cache) {
        if cache.tokens {
            let rate = predictor.queue_rate(role);
            let features = features_of(&choice.worker, tokens.len(), cache.matched, rate);
            seen.note(&choice.worker.base, features);
            // A decode worker after a transfer computes nothing of the prompt.
            if role != WorkerRole::Decode || route.local_prefill {
                seen.claim(&choice.worker, features.uncached_tokens as u64);
            }
        }
    }
    Some(choice)
}

fn log_choice(policy: &str, role: WorkerRole, chosen: &Worker, candidates: usize) {
    tracing::debug!(
        policy,
        %role,
        worker = %chosen.base,
        in_flight = chosen.in_flight(),
        candidates,
        "routed"
    );
}
