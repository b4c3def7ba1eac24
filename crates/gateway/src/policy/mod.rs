//! Routing policies: which live worker of a role serves a request.
//!
//! A policy sees the live workers the registry offers (minus those a retry already
//! tried) and the request's routing facts; it is told when each request it routed ends,
//! so load- and outcome-aware policies can keep their own state.
//!
//! Policies (`--policy`): `round_robin`, `random`, `power_of_two` (fewer in-flight of two
//! random candidates), `cache_aware` (an approximate prefix tree per worker, bounded by
//! `max_tree_size`), `precise_prefix` (the workers' own KV-event indexes, net of load;
//! `cache_aware` where there are no events), `session` (rendezvous hashing on a
//! session key) and `slo` (predicted latency against the request's objectives,
//! `precise_prefix` until the predictor is trained).

mod cache_aware;
mod event_match;
pub mod fleet_bench;
mod in_flight;
mod power_of_two;
mod precise_prefix;
pub mod predictor;

pub mod prefix_tree;
mod random;
mod round_robin;
mod sent_blocks;
mod session;
mod slo;
#[cfg(test)]
pub(crate) mod testing;

use std::fmt;
use std::sync::{Arc, Mutex};

use http::HeaderMap;
use pdserve_protocol::{Prompt, WorkerRole};

use crate::endpoint::Endpoint;
use crate::fleet::kv_events::{KvEventMetrics, KvEventsHub};
pub use crate::fleet::registry::RequestOutcome;
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;
pub use cache_aware::{CacheAware, CacheSource};
pub use event_match::{EventMatcher, Held};
pub use in_flight::InFlight;
pub use power_of_two::PowerOfTwo;
pub use precise_prefix::PrecisePrefix;
pub use random::Random;
pub use round_robin::RoundRobin;
pub use session::Session;
pub use slo::SloPolicy;

/// What a policy may route on.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The endpoint the request targets.
    pub endpoint: Endpoint,
    /// The validated generation request, when the route carries one.
    pub request: Option<&'a ClientRequest>,
    /// The client's headers (session ids and the like).
    pub headers: &'a HeaderMap,
    /// The gateway's `conversation_id`, when the client sent one.
    pub conversation_id: Option<&'a str>,
    /// The prompt's token ids, when the gateway tokenized it (`--tokenizer`).
    pub tokens: Option<&'a [u32]>,
    /// Where the chosen workers' cache matches are written down (`--expose-routing`).
    pub notes: Option<&'a RoutingNotes>,
    /// A worker (its base URL) chosen over the policy's choice whenever it is a
    /// candidate: the one that stores the conversation a Responses request continues.
    pub prefer: Option<&'a str>,
    /// The request's span, under which each choice records a `routing` span.
    pub trace: Option<&'a pdserve_telemetry::Context>,
    /// Where the chosen workers' features are noted, for the latency predictor to learn
    /// from once the request ends.
    pub seen: Option<&'a predictor::SeenFeatures>,
    /// The request's latency objectives (`slo` routes on them).
    pub slo: crate::ingress::slo::Slo,
    /// Whether the decode worker chosen prefills the prompt itself (conditional
    /// disaggregation skipped the prefill leg).
    pub local_prefill: bool,
}

/// Where a cache match came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchSource {
    /// The worker's own KV events (and the prompts just sent it, until they arrive).
    Events,
    /// The gateway's approximate prefix tree of what it sent the worker.
    Approximate,
}

/// The chosen worker's cached share of the prompt, as the policy saw it when choosing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheMatch {
    /// Where the policy learned it.
    pub source: MatchSource,
    /// How much of the prompt's start the worker holds.
    pub matched: usize,
    /// The prompt's length.
    pub prompt_len: usize,
    /// Whether both lengths count token ids (else characters of text).
    pub tokens: bool,
}

impl CacheMatch {
    /// The `--expose-routing` header value: `events; matched=128; prompt=300; unit=tokens`.
    pub fn header_value(&self) -> String {
        let source = match self.source {
            MatchSource::Events => "events",
            MatchSource::Approximate => "approximate",
        };
        let unit = if self.tokens { "tokens" } else { "chars" };
        format!(
            "{source}; matched={}; prompt={}; unit={unit}",
            self.matched, self.prompt_len
        )
    }
}

/// A policy's choice and, for prefix-aware policies, what the worker held.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The chosen worker.
    pub worker: Arc<Worker>,
    /// Its cache match at the time of choosing.
    pub cache: Option<CacheMatch>,
    /// What it was predicted to give the request (`slo`).
    pub forecast: Option<predictor::Forecast>,
}

/// The cache matches of the workers a request was routed to, and the latency each was
/// predicted to give it, kept for its response headers.
#[derive(Debug, Default)]
pub struct RoutingNotes {
    matches: Mutex<Vec<(String, CacheMatch)>>,
    forecasts: Mutex<Vec<(String, predictor::Forecast)>>,
}

impl RoutingNotes {
    /// Notes that `worker` was chosen holding `cache`.
    pub fn record(&self, worker: &Worker, cache: CacheMatch) {
        let mut matches = self.matches.lock().unwrap_or_else(|e| e.into_inner());
        matches.retain(|(base, _)| *base != worker.base);
        matches.push((worker.base.clone(), cache));
    }

    /// What `worker` held when it was last chosen for this request.
    pub fn get(&self, worker: &Worker) -> Option<CacheMatch> {
        let matches = self.matches.lock().unwrap_or_else(|e| e.into_inner());
        matches
            .iter()
            .find(|(base, _)| *base == worker.base)
            .map(|(_, m)| *m)
    }

    /// Notes that `worker` was chosen on the prediction `forecast`.
    pub fn record_forecast(&self, worker: &Worker, forecast: predictor::Forecast) {
        let mut forecasts = self.forecasts.lock().unwrap_or_else(|e| e.into_inner());
        forecasts.retain(|(base, _)| *base != worker.base);
        forecasts.push((worker.base.clone(), forecast));
    }

    /// What `worker` was predicted to give the request when it was last chosen.
    pub fn forecast(&self, worker: &Worker) -> Option<predictor::Forecast> {
        let forecasts = self.forecasts.lock().unwrap_or_else(|e| e.into_inner());
        forecasts
            .iter()
            .find(|(base, _)| *base == worker.base)
            .map(|(_, f)| *f)
    }
}

/// A request's prompt as a policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum RoutePrompt<'a> {
    /// Prompt text (chat messages are joined in order, each prefixed by its role).
    Text(String),
    /// Prompt token ids, when the client sent them.
    TokenIds(&'a [u32]),
}

impl<'a> RouteRequest<'a> {
    /// A context for a request without a body (e.g. `/v1/models`).
    pub fn bodyless(endpoint: Endpoint, headers: &'a HeaderMap) -> Self {
        Self {
            endpoint,
            request: None,
            headers,
            conversation_id: None,
            tokens: None,
            notes: None,
            prefer: None,
            trace: None,
            seen: None,
            slo: Default::default(),
            local_prefill: false,
        }
    }

    /// The prompt (the first one of a batch), computed on demand so policies that do
    /// not look at it cost nothing.
    pub fn prompt(&self) -> Option<RoutePrompt<'a>> {
        if let Some(tokens) = self.tokens {
            return Some(RoutePrompt::TokenIds(tokens));
        }
        match self.request? {
            ClientRequest::Chat(chat) => {
                let mut text = String::new();
                for m in &chat.messages {
                    text.push_str(&m.role);
                    text.push('\n');
                    if let Some(content) = &m.content {
                        text.push_str(&content.text());
                    }
                    text.push('\n');
                }
                Some(RoutePrompt::Text(text))
            }
            ClientRequest::Completion(c) => match &c.prompt {
                Prompt::Text(t) => Some(RoutePrompt::Text(t.clone())),
                Prompt::Texts(t) => t.first().map(|t| RoutePrompt::Text(t.clone())),
                Prompt::Tokens(ids) => Some(RoutePrompt::TokenIds(ids)),
                Prompt::TokenBatches(b) => b.first().map(|ids| RoutePrompt::TokenIds(ids)),
            },
        }
    }
}

/// Chooses workers for requests.
pub trait Policy: fmt::Debug + Send + Sync {
    /// The policy's name (`--policy` value).
    fn name(&self) -> &'static str;

    /// One of `candidates` (live workers of `role`, none tried yet by this request), or
    /// `None` when there are none.
    fn select(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Arc<Worker>>;

    /// [`Policy::select`], with the chosen worker's cache match where the policy keeps
    /// prefix state.
    fn choose(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Choice> {
        self.select(role, candidates, request).map(|worker| Choice {
            worker,
            cache: None,
            forecast: None,
        })
    }

    /// What each of `candidates` is predicted to give the request, in their order, where
    /// the policy predicts latency (`slo`, once trained); `None` otherwise.
    fn forecast(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<Vec<predictor::Forecast>> {
        let _ = (role, candidates, request);
        None
    }

    /// Called once for every request this policy routed, when it ends on `worker`.
    fn on_request_end(&self, worker: &Worker, outcome: RequestOutcome) {
        let _ = (worker, outcome);
    }

    /// The request with prompt `tokens` that this policy sent `worker` did not reach it or
    /// was refused there (a 4xx): what the policy noted as sent there is not there.
    fn forget_sent(&self, worker: &Worker, tokens: &[u32]) {
        let _ = (worker, tokens);
    }

    /// The candidate with the longest cached prefix of the request's prompt, as the
    /// policy believes it, without recording the request (conditional disaggregation
    /// asks this before routing). `None`: the policy keeps no prefix state, the request
    /// has no prompt, or no candidate has any of it.
    fn cached_prefix(
        &self,
        role: WorkerRole,
        candidates: &[Arc<Worker>],
        request: &RouteRequest<'_>,
    ) -> Option<PrefixMatch> {
        let _ = (role, candidates, request);
        None
    }

    /// Approximate bytes the policy's prefix trees hold (a metric; 0 without trees).
    fn tree_size(&self) -> usize {
        0
    }

    /// Whether choices read the prompt (its token ids where the gateway has them), so
    /// `--tokenizer` should tokenize every request for them.
    fn reads_prompt(&self) -> bool {
        false
    }

    /// Counters of the policy's decisions (zero for policies that keep none).
    fn stats(&self) -> PolicyStats {
        PolicyStats::default()
    }

    /// Drops state kept for workers whose base URL is not in `live` (the roster changed).
    /// Policies also forget idle workers on their own, so calling this is optional.
    fn retain_workers(&self, live: &[&str]) {
        let _ = live;
    }
}

/// A candidate's cached share of a prompt, in the prompt's unit: characters for text,
/// token ids for token prompts.
#[derive(Debug, Clone)]
pub struct PrefixMatch {
    /// The candidate with the longest cached prefix.
    pub worker: Arc<Worker>,
    /// How much of the prompt's start it has cached.
    pub matched: usize,
    /// The prompt's length.
    pub prompt_len: usize,
}

/// Decision counters of a policy, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyStats {
    /// Requests routed to the worker with the longest prefix match (above the threshold).
    pub cache_hits: u64,
    /// Requests whose best match was at or below the threshold (routed by load).
    pub cache_misses: u64,
    /// Requests routed to the least-loaded worker because load was imbalanced.
    pub imbalanced: u64,
}

/// Tuning of the policies (`--cache-threshold`, `--balance-*-threshold`,
/// `--max-tree-size`, `--session-fallback`).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// cache_aware routes to the longest match when matched / prompt length exceeds this.
    pub cache_threshold: f64,
    /// Load is imbalanced when max − min in-flight exceeds this (and the relative test holds).
    pub balance_abs_threshold: usize,
    /// Load is imbalanced when max in-flight exceeds min × this (and the absolute test holds).
    pub balance_rel_threshold: f64,
    /// Cap of each worker's prefix tree (one per role and prompt kind), in approximate
    /// heap bytes: stored prompt bytes or token ids (4 bytes each) plus a fixed per-node
    /// overhead; least recently used branches are evicted past it.
    pub max_tree_size: usize,
    /// The policy `session` uses for requests without a session key.
    pub session_fallback: String,
    /// cache_aware: prompts of compute one extra in-flight request is taken to cost; the
    /// longest match loses to the least-loaded worker when its extra load costs more than
    /// its lead in cached tokens. 0 turns the comparison off (SGLang's behaviour).
    pub queue_cost: f64,
    /// precise_prefix: the share of the prompt one request of load costs; a worker whose
    /// events hold more of the prompt than another wins unless its extra load costs more.
    pub precise_load_cost: f64,
    /// cache_aware: what a worker's match is read from (`--cache-source`).
    pub cache_source: CacheSource,
}

/// Default `max_tree_size`: 8 MiB per worker tree (about 2M tokens of prompt text).
pub const DEFAULT_MAX_TREE_SIZE: usize = 8 << 20;

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.5,
            max_tree_size: DEFAULT_MAX_TREE_SIZE,
            session_fallback: "round_robin".to_string(),
            queue_cost: 0.0,
            precise_load_cost: 0.1,
            cache_source: CacheSource::Auto,
        }
    }
}

impl PolicyConfig {
    /// Checks the values; the error names the offending setting.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(format!(
                "--cache-threshold must be between 0 and 1, got {}",
                self.cache_threshold
            ));
        }
        if !self.balance_rel_threshold.is_finite() || self.balance_rel_threshold < 0.0 {
            return Err(format!(
                "--balance-rel-threshold must be a non-negative number, got {}",
                self.balance_rel_threshold
            ));
        }
        if !self.queue_cost.is_finite() || self.queue_cost < 0.0 {
            return Err(format!(
                "--cache-queue-cost must be a non-negative number, got {}",
                self.queue_cost
            ));
        }
        if !self.precise_load_cost.is_finite() || self.precise_load_cost < 0.0 {
            return Err(format!(
                "--precise-load-cost must be a non-negative number, got {}",
                self.precise_load_cost
            ));
        }
        if self.max_tree_size == 0 {
            return Err("--max-tree-size must be at least 1".to_string());
        }
        if self.session_fallback == "session"
            || !POLICY_NAMES.contains(&self.session_fallback.as_str())
        {
            return Err(format!(
                "--session-fallback must be one of round_robin, random, power_of_two, cache_aware, precise_prefix, slo; got `{}`",
                self.session_fallback
            ));
        }
        Ok(())
    }
}

/// The policy named `name` with default tuning.
pub fn by_name(name: &str) -> Option<Arc<dyn Policy>> {
    build(name, &PolicyConfig::default())
}

/// The policy named `name` tuned by `config`; `None` for an unknown name (or, for
/// `session`, an unknown or `session` fallback: [`PolicyConfig::validate`] says which).
/// `precise_prefix` gets an index hub of its own that nothing feeds; the gateway builds
/// it with [`build_with`].
pub fn build(name: &str, config: &PolicyConfig) -> Option<Arc<dyn Policy>> {
    let hub = Arc::new(KvEventsHub::new(
        Default::default(),
        Arc::new(KvEventMetrics::register(&mut Default::default())),
    ));
    build_with(
        name,
        config,
        &hub,
        &Arc::new(predictor::LatencyPredictor::new()),
    )
}

/// [`build`], with `precise_prefix` reading `hub`'s indexes and `slo` predicting with
/// `predictor`.
pub fn build_with(
    name: &str,
    config: &PolicyConfig,
    hub: &Arc<KvEventsHub>,
    predictor: &Arc<predictor::LatencyPredictor>,
) -> Option<Arc<dyn Policy>> {
    match name {
        "round_robin" => Some(Arc::new(RoundRobin::default())),
        "random" => Some(Arc::new(Random)),
        "power_of_two" => Some(Arc::new(PowerOfTwo)),
        "cache_aware" => Some(Arc::new(CacheAware::with_events(config, hub))),
        "precise_prefix" => Some(Arc::new(PrecisePrefix::new(
            hub.clone(),
            CacheAware::new(config),
            config.precise_load_cost,
        ))),
        "session" if config.session_fallback != "session" => Some(Arc::new(Session::new(
            build_with(&config.session_fallback, config, hub, predictor)?,
        ))),
        "slo" => Some(Arc::new(SloPolicy::new(
            PrecisePrefix::new(
                hub.clone(),
                CacheAware::new(config),
                config.precise_load_cost,
            ),
            predictor.clone(),
        ))),
        _ => None,
    }
}

/// Every `--policy` name this build knows.
pub const POLICY_NAMES: &[&str] = &[
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "precise_prefix",
    "session",
    "slo",
];

/// A dense index per role, for policies that keep per-role state in an array.
pub(crate) fn role_index(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Decode => 1,
        WorkerRole::PrefillDecode => 2,
        WorkerRole::Encode => 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_name_builds_under_its_own_name() {
        assert_eq!(POLICY_NAMES.len(), 7);
        for name in POLICY_NAMES {
            assert_eq!(by_name(name).unwrap().name(), *name);
            assert_eq!(build(name, &PolicyConfig::default()).unwrap().name(), *name);
        }
        assert!(by_name("least_loaded").is_none());
    }

    #[test]
    fn defaults_are_sglangs_and_validate() {
        let d = PolicyConfig::default();
        assert_eq!(
            (
                d.cache_threshold,
                d.balance_abs_threshold,
                d.balance_rel_threshold
            ),
            (0.5, 32, 1.5)
        );
        assert_eq!(d.session_fallback, "round_robin");
        assert!(d.validate().is_ok());
        let bad = [
            PolicyConfig {
                cache_threshold: 1.5,
                ..d.clone()
            },
            PolicyConfig {
                balance_rel_threshold: f64::NAN,
                ..d.clone()
            },
            PolicyConfig {
                max_tree_size: 0,
                ..d.clone()
            },
            PolicyConfig {
                session_fallback: "session".into(),
                ..d.clone()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
