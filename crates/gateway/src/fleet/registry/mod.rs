//! The live worker set: registration, removal, health-driven eviction and re-admission.
//!
//! Requests read an immutable [`Roster`] snapshot through an atomically swapped pointer,
//! so the hot path takes no lock; every change (register, unregister, evict, re-admit,
//! forget) builds a new roster under a writer-only mutex and swaps it in.

pub mod circuit;
mod metrics;
pub mod probe;
mod prompt_backlog;
mod refusal;
mod routing_line;
mod source;
mod worker;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use pdserve_protocol::WorkerRole;
use tokio::sync::watch;

pub use circuit::{BreakerSettings, CircuitBreaker, CircuitState, RequestOutcome};
pub use metrics::FleetMetrics;
pub use prompt_backlog::ClaimId;
pub use refusal::RefusedReason;
pub use source::{SyncReport, WorkerSource};
pub use worker::{
    check_dp_size, parse_worker_url, url_id, worker_key, Health, Worker, WorkerSpec, WorkerState,
    MAX_DP_SIZE,
};

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// `prefill_decode` workers and split prefill/decode workers cannot serve side by side.
    #[error(
        "cannot mix prefill_decode workers with standalone prefill/decode workers \
         (unregister the {existing} workers first)"
    )]
    MixedTopology {
        /// The role already registered that conflicts.
        existing: WorkerRole,
    },
    /// The URL is registered with another role.
    #[error(
        "{url} is registered as {existing}; unregister it before registering it as {requested}"
    )]
    RoleChange {
        /// The worker's URL.
        url: String,
        /// Its current role.
        existing: WorkerRole,
        /// The role asked for.
        requested: WorkerRole,
    },
    /// The roster holds `--max-workers` workers already.
    #[error("the roster is full: it holds {max} workers, the most --max-workers allows")]
    Full {
        /// The limit.
        max: usize,
    },
}

/// Eviction settings (`--fail-threshold`, `--evicted-ttl`) and the roster's size limit
/// (`--max-workers`).
#[derive(Debug, Clone, Copy)]
pub struct HealthPolicy {
    /// Most workers the roster holds.
    pub max_workers: usize,
    /// Consecutive failed probes that evict a live worker (at least 1).
    pub fail_threshold: u32,
    /// How long an evicted worker is still probed before it is forgotten; `None`: forever.
    pub evicted_ttl: Option<Duration>,
    /// Each worker's circuit breaker settings.
    pub breaker: BreakerSettings,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            max_workers: 4096,
            fail_threshold: 3,
            evicted_ttl: Some(Duration::from_secs(900)),
            breaker: BreakerSettings::default(),
        }
    }
}

/// One registered worker and its routing state.
#[derive(Debug, Clone)]
pub struct Member {
    /// The worker.
    pub worker: Arc<Worker>,
    /// Whether it receives traffic.
    pub health: Health,
    /// When it was evicted (for the TTL).
    pub evicted_since: Option<Instant>,
    /// Where the worker came from.
    pub source: WorkerSource,
}

/// What [`Registry::admit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admitted {
    Added,
    Updated,
    Unchanged,
}

/// How requests can be served with the live workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Prefill on one worker, decode on another.
    Disaggregated,
    /// One `prefill_decode` worker does both.
    Aggregated,
    /// Nothing can serve a request.
    Unavailable,
}

impl Mode {
    /// The mode's name in `/health` and `/instances`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disaggregated => "disaggregated",
            Self::Aggregated => "aggregated",
            Self::Unavailable => "unavailable",
        }
    }
}

/// An immutable view of the registered workers, read by requests without locking.
#[derive(Debug, Default)]
pub struct Roster {
    members: Vec<Member>,
    /// Live workers per role, indexed by [`role_index`].
    live: [Vec<Arc<Worker>>; 4],
    /// Evicted workers per role that are not draining, routed to only while the role has
    /// no live worker.
    evicted: [Vec<Arc<Worker>>; 4],
}

/// The workers a request of one role may be sent to.
#[derive(Debug, Clone, Copy)]
pub struct Routable<'a> {
    /// The candidates: the live workers, or, when none is live, the evicted ones.
    pub workers: &'a [Arc<Worker>],
    /// The candidates are evicted workers (panic routing, as Envoy's panic threshold):
    /// a worker that came back before its next probe serves at once instead of the
    /// gateway refusing without trying.
    pub panic: bool,
}

fn role_index(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Decode => 1,
        WorkerRole::PrefillDecode => 2,
        WorkerRole::Encode => 3,
    }
}

impl Roster {
    fn from_members(members: Vec<Member>) -> Self {
        let mut live: [Vec<Arc<Worker>>; 4] = Default::default();
        let mut evicted: [Vec<Arc<Worker>>; 4] = Default::default();
        for m in &members {
            let by_health = match m.health {
                Health::Live => &mut live,
                // A draining worker refuses new requests: not worth a panic try.
                Health::Evicted if m.worker.is_draining() => continue,
                Health::Evicted => &mut evicted,
            };
            by_health[role_index(m.worker.role())].push(m.worker.clone());
        }
        Self {
            members,
            live,
            evicted,
        }
    }

    /// The workers of `role` a request may go to: the live ones, else (panic) every
    /// evicted one. Health reporting reads [`Roster::live`] instead.
    pub fn routable(&self, role: WorkerRole) -> Routable<'_> {
        let i = role_index(role);
        match &self.live[i] {
            live if !live.is_empty() => Routable {
                workers: live,
                panic: false,
            },
            _ => Routable {
                workers: &self.evicted[i],
                panic: !self.evicted[i].is_empty(),
            },
        }
    }

    /// How requests are served now: [`Roster::mode`] over the routable workers, so an
    /// evicted pool is still tried (panic routing) rather than refused.
    pub fn routing_mode(&self) -> Mode {
        let has = |role| !self.routable(role).workers.is_empty();
        if has(WorkerRole::Prefill) && has(WorkerRole::Decode) {
            Mode::Disaggregated
        } else if has(WorkerRole::PrefillDecode) {
            Mode::Aggregated
        } else {
            Mode::Unavailable
        }
    }

    /// Every registered worker, live or evicted, in registration order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The live workers of `role`, in registration order.
    pub fn live(&self, role: WorkerRole) -> &[Arc<Worker>] {
        &self.live[role_index(role)]
    }

    /// The registered worker at `key` (its URL without a trailing `/`).
    pub fn get(&self, key: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.worker.base == key)
    }

    /// Whether `worker` is this roster's current record for its URL.
    fn holds(&self, worker: &Arc<Worker>) -> Option<usize> {
        self.members
            .iter()
            .position(|m| Arc::ptr_eq(&m.worker, worker))
    }

    /// P/D when a live prefill and a live decode worker exist, else aggregated when a
    /// live `prefill_decode` worker does (what `/health` reports; routing reads
    /// [`Roster::routing_mode`]).
    pub fn mode(&self) -> Mode {
        if !self.live(WorkerRole::Prefill).is_empty() && !self.live(WorkerRole::Decode).is_empty() {
            Mode::Disaggregated
        } else if !self.live(WorkerRole::PrefillDecode).is_empty() {
            Mode::Aggregated
        } else {
            Mode::Unavailable
        }
    }
}

/// The live worker set, shared by requests, the admin API and the prober.
#[derive(Debug)]
pub struct Registry {
    roster: ArcSwap<Roster>,
    /// Serialises read-modify-write of the roster (never held by requests).
    writer: Mutex<()>,
    metrics: Arc<FleetMetrics>,
    policy: HealthPolicy,
    /// Bumped on every roster change; the pre-warmer listens.
    changes: watch::Sender<u64>,
    /// Per-role rotation of [`Registry::assign`], indexed by [`role_index`]. Only ever
    /// advanced: restarting it on roster changes would hot-spot the first worker.
    cursors: [AtomicUsize; 4],
}

impl Registry {
    /// An empty registry.
    pub fn new(metrics: Arc<FleetMetrics>, policy: HealthPolicy) -> Self {
        Self {
            roster: ArcSwap::from_pointee(Roster::default()),
            writer: Mutex::new(()),
            metrics,
            policy: HealthPolicy {
                fail_threshold: policy.fail_threshold.max(1),
                ..policy
            },
            changes: watch::channel(0).0,
            cursors: Default::default(),
        }
    }

    /// `count` routable workers of `role` in round-robin order, continuing where the
    /// previous call stopped, so that a request's items (and consecutive requests) spread
    /// over the pool instead of each starting at its first worker. Workers whose circuit
    /// is open are passed over while another worker admits traffic. Evicted workers are
    /// assigned only while none of the role is live (panic routing). Empty when none is
    /// registered.
    pub fn assign(&self, role: WorkerRole, count: usize) -> Vec<Arc<Worker>> {
        let roster = self.snapshot();
        let routable = roster.routable(role);
        if routable.panic && count > 0 {
            self.note_panic(role, count, "all are evicted");
        }
        let live = routable.workers;
        let open: Vec<Arc<Worker>> = live
            .iter()
            .filter(|w| w.breaker.is_candidate())
            .cloned()
            .collect();
        let pool = if open.is_empty() { live } else { &open[..] };
        if pool.is_empty() || count == 0 {
            return Vec::new();
        }
        let start = self.cursors[role_index(role)].fetch_add(count, Ordering::Relaxed);
        (0..count)
            .map(|offset| pool[start.wrapping_add(offset) % pool.len()].clone())
            .collect()
    }

    /// The current roster (a cheap pointer copy; it never changes under the caller).
    pub fn snapshot(&self) -> Arc<Roster> {
        self.roster.load_full()
    }

    /// A receiver that sees every roster change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // The guarded data is the roster, which is swapped whole: a panic cannot tear it.
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, members: Vec<Member>) {
        for role in WorkerRole::ALL {
            let (live, evicted) = members.iter().filter(|m| m.worker.role() == role).fold(
                (0, 0),
                |(l, e), m| match m.health {
                    Health::Live => (l + 1, e),
                    Health::Evicted => (l, e + 1),
                },
            );
            self.metrics.set_workers(role.as_str(), live, evicted);
        }
        self.roster.store(Arc::new(Roster::from_members(members)));
        self.changes.send_modify(|v| *v += 1);
    }

    fn new_worker(&self, spec: WorkerSpec) -> Worker {
        let (role, key) = (spec.role.as_str(), spec.key());
        let breaker = CircuitBreaker::new(
            self.policy.breaker,
            self.metrics.worker_circuit_state(role, &key),
        );
        Worker::with_breaker(spec, self.metrics.worker_in_flight(role, &key), breaker)
    }

    /// Registers a worker, live at once. Returns `false` when the URL was already
    /// registered (an identical record is a no-op; a changed `dp_size` or
    /// `bootstrap_port` is updated in place, keeping its health).
    pub fn register(&self, spec: WorkerSpec) -> Result<bool, RegistryError> {
        self.register_from(spec, WorkerSource::Registration)
    }

    /// [`Registry::register`], naming where the worker came from.
    pub fn register_from(
        &self,
        spec: WorkerSpec,
        source: WorkerSource,
    ) -> Result<bool, RegistryError> {
        let _guard = self.lock();
        let mut members = self.roster.load().members().to_vec();
        let outcome = self.admit(&mut members, spec, source)?;
        if outcome != Admitted::Unchanged {
            self.publish(members);
        }
        Ok(outcome == Admitted::Added)
    }

    /// Adds `spec` to `members`, or updates its record in place.
    fn admit(
        &self,
        members: &mut Vec<Member>,
        spec: WorkerSpec,
        source: WorkerSource,
    ) -> Result<Admitted, RegistryError> {
        let split = |r| matches!(r, WorkerRole::Prefill | WorkerRole::Decode);
        for m in members.iter() {
            let existing = m.worker.role();
            let mixes = (spec.role == WorkerRole::PrefillDecode && split(existing))
                || (split(spec.role) && existing == WorkerRole::PrefillDecode);
            if mixes {
                return Err(RegistryError::MixedTopology { existing });
            }
        }
        let key = spec.key();
        if let Some(i) = members.iter().position(|m| m.worker.base == key) {
            let previous = &members[i].worker;
            if previous.role() != spec.role {
                return Err(RegistryError::RoleChange {
                    url: key,
                    existing: previous.role(),
                    requested: spec.role,
                });
            }
            if previous.spec == spec {
                return Ok(Admitted::Unchanged);
            }
            let updated = Arc::new(Worker::new(
                spec,
                self.metrics
                    .worker_in_flight(previous.role().as_str(), &key),
            ));
            updated.inherit(previous);
            members[i].worker = updated;
            return Ok(Admitted::Updated);
        }
        if members.len() >= self.policy.max_workers {
            return Err(RegistryError::Full {
                max: self.policy.max_workers,
            });
        }
        tracing::info!(role = %spec.role, url = %key, dp_size = spec.dp_size, %source, "registered worker");
        let worker = self.new_worker(spec);
        members.push(Member {
            worker: Arc::new(worker),
            health: Health::Live,
            evicted_since: None,
            source,
        });
        Ok(Admitted::Added)
    }

    /// Removes the worker at `key` for good (a probe in flight cannot bring it back).
    /// Requests already on it finish; it gets no new ones.
    pub fn unregister(&self, key: &str) -> bool {
        let _guard = self.lock();
        let roster = self.roster.load();
        let Some(i) = roster.members().iter().position(|m| m.worker.base == key) else {
            return false;
        };
        let mut members = roster.members().to_vec();
        let removed = members.remove(i);
        tracing::info!(role = %removed.worker.role(), url = %key, "unregistered worker");
        self.metrics
            .forget_worker(removed.worker.role().as_str(), key);
        self.publish(members);
        true
    }

    /// A successful probe: clears the failure count and re-admits an evicted worker.
    /// Ignored when `worker` is no longer the registered record for its URL.
    pub fn record_success(&self, worker: &Arc<Worker>) {
        worker.record_success();
        if worker.is_draining() {
            self.record_draining(worker, false);
        }
        if self.set_health(worker, Health::Evicted, Health::Live) {
            tracing::info!(role = %worker.role(), url = %worker.base, "worker is healthy again; routing to it resumes");
            self.metrics.inc_readmissions(worker.role().as_str());
        }
    }

    /// A passing health probe: as [`Registry::record_success`], and an open circuit
    /// breaker lets its trial request through at once (a restarted worker serves the
    /// next request instead of waiting out the cooldown).
    pub fn record_probe_passed(&self, worker: &Arc<Worker>) {
        self.record_success(worker);
        if worker.breaker.probe_passed() {
            tracing::info!(
                role = %worker.role(),
                url = %worker.base,
                "health probe passed: the open circuit lets its trial request through now"
            );
        }
    }

    /// A probe found the worker draining for shutdown (`draining: true`): it is evicted
    /// at once and kept out of panic routing; a later passing probe clears it.
    pub fn record_draining(&self, worker: &Arc<Worker>, draining: bool) {
        if !worker.set_draining(draining) {
            return;
        }
        if draining {
            tracing::info!(role = %worker.role(), url = %worker.base, "worker is draining for shutdown; no new requests go to it");
            self.record_failure(worker, true, "its /health says it is draining");
        }
        // Rebuild the roster so that panic routing sees the change.
        let _guard = self.lock();
        let roster = self.roster.load();
        if roster.holds(worker).is_some() {
            self.publish(roster.members().to_vec());
        }
    }

    /// A worker answered a request: an evicted one (tried in panic, or evicted while the
    /// request ran) is re-admitted at once rather than at its next probe. Costs one
    /// atomic load when the worker is live.
    pub fn record_answer(&self, worker: &Arc<Worker>) {
        if worker.is_evicted() {
            self.record_success(worker);
        }
    }

    /// Counts and logs requests routed to workers of `role` that health or their breaker
    /// keeps out (`why`), because no worker of the role is routable otherwise.
    pub(crate) fn note_panic(&self, role: WorkerRole, requests: usize, why: &str) {
        self.metrics.inc_panic_routed(role.as_str());
        tracing::warn!(
            %role,
            requests,
            "no healthy {role} worker ({why}): routing to them anyway (panic routing) rather than refusing"
        );
    }

    /// A failed probe (or request): evicts a live worker once it reaches the failure
    /// threshold, or at once when `conclusive` (nothing accepted the connection).
    /// Ignored when `worker` is no longer the registered record for its URL, so a probe
    /// racing an unregistration cannot bring the worker back.
    pub fn record_failure(&self, worker: &Arc<Worker>, conclusive: bool, why: &str) {
        let failures = worker.record_failure();
        if failures < self.policy.fail_threshold && !conclusive {
            return;
        }
        if self.set_health(worker, Health::Live, Health::Evicted) {
            tracing::warn!(
                role = %worker.role(),
                url = %worker.base,
                failures,
                "worker evicted ({why}); no new requests go to it until it answers /health again"
            );
            self.metrics.inc_evictions(worker.role().as_str());
        }
    }

    /// Moves `worker` from `from` to `to` if it is still the registered record for its
    /// URL and in `from`; returns whether it moved. The roster is checked without the
    /// writer lock first, so the common case (nothing to change) takes no lock.
    fn set_health(&self, worker: &Arc<Worker>, from: Health, to: Health) -> bool {
        let in_from = |roster: &Roster| {
            roster
                .holds(worker)
                .filter(|&i| roster.members()[i].health == from)
        };
        if in_from(&self.roster.load()).is_none() {
            return false;
        }
        let _guard = self.lock();
        let roster = self.roster.load();
        let Some(i) = in_from(&roster) else {
            return false;
        };
        let mut members = roster.members().to_vec();
        members[i].health = to;
        members[i].evicted_since = (to == Health::Evicted).then(Instant::now);
        members[i].worker.set_evicted(to == Health::Evicted);
        self.publish(members);
        true
    }

    /// Forgets workers evicted for longer than `--evicted-ttl`.
    pub fn forget_expired(&self, now: Instant) {
        let Some(ttl) = self.policy.evicted_ttl else {
            return;
        };
        let expired = |m: &Member| {
            m.evicted_since
                .is_some_and(|t| now.duration_since(t) >= ttl)
        };
        if !self.roster.load().members().iter().any(expired) {
            return;
        }
        let _guard = self.lock();
        let roster = self.roster.load();
        let (gone, kept): (Vec<_>, Vec<_>) =
            roster.members().iter().cloned().partition(|m| expired(m));
        if gone.is_empty() {
            return;
        }
        for m in &gone {
            self.metrics
                .forget_worker(m.worker.role().as_str(), &m.worker.base);
            tracing::warn!(role = %m.worker.role(), url = %m.worker.base, "worker stayed down past --evicted-ttl; forgetting it");
        }
        self.publish(kept);
    }
}

#[cfg(test)]
mod tests;
