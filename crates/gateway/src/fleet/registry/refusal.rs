//! Why no worker of a role can take a request: the 503's reason and message, counted in
//! `pdserve_gateway_refused_total{role,reason}`.

use pdserve_protocol::{ApiError, WorkerRole};

use super::worker::WorkerState;
use super::{Mode, Registry, Roster};

/// The state that kept every worker of a role from a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedReason {
    /// No worker of the role is registered.
    NoWorker,
    /// The workers are evicted (failed health probes) and the one tried refused the
    /// connection.
    Evicted,
    /// The workers' circuit breakers are open and the one tried refused the connection.
    BreakerOpen,
    /// The workers are draining for shutdown.
    Draining,
    /// Every routable worker was tried and failed this request.
    AllTried,
}

impl RefusedReason {
    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoWorker => "no_worker",
            Self::Evicted => "evicted",
            Self::BreakerOpen => "breaker_open",
            Self::Draining => "draining",
            Self::AllTried => "all_tried",
        }
    }

    /// The reason a worker in `state` gives when it cannot take a request (`None` for a
    /// live worker: its failure is its own, not a refusal).
    pub fn of(state: WorkerState) -> Option<Self> {
        match state {
            WorkerState::Live => None,
            WorkerState::Evicted => Some(Self::Evicted),
            WorkerState::BreakerOpen => Some(Self::BreakerOpen),
            WorkerState::Draining => Some(Self::Draining),
        }
    }
}

impl Roster {
    /// The roles that keep requests from being served, where `has(role)` says whether a
    /// role has a worker: prefill and decode when split workers are registered (or none
    /// at all, then `prefill_decode` too), else `prefill_decode`.
    fn missing_roles(&self, has: impl Fn(WorkerRole) -> bool) -> Vec<WorkerRole> {
        let registered = |role| self.members().iter().any(|m| m.worker.role() == role);
        let split = registered(WorkerRole::Prefill) || registered(WorkerRole::Decode);
        if !split && registered(WorkerRole::PrefillDecode) {
            return vec![WorkerRole::PrefillDecode];
        }
        let mut out: Vec<WorkerRole> = [WorkerRole::Prefill, WorkerRole::Decode]
            .into_iter()
            .filter(|&role| !has(role))
            .collect();
        if !split {
            out.push(WorkerRole::PrefillDecode);
        }
        out
    }

    /// What keeps the gateway from serving, in words, judged by live workers as
    /// `/health` reports (empty when it can serve).
    pub fn missing(&self) -> Vec<String> {
        if self.mode() != Mode::Unavailable {
            return Vec::new();
        }
        self.missing_roles(|role| !self.live(role).is_empty())
            .into_iter()
            .map(|role| self.refusal(role).1)
            .collect()
    }

    /// Why no worker of `role` can take a request, in a sentence naming how many are in
    /// each state (routing found none: none registered, every one draining, or every
    /// routable one tried).
    pub fn refusal(&self, role: WorkerRole) -> (RefusedReason, String) {
        let mut counts = [0usize; 4];
        for m in self.members().iter().filter(|m| m.worker.role() == role) {
            let i = match m.worker.state() {
                WorkerState::Live => 0,
                WorkerState::Evicted => 1,
                WorkerState::BreakerOpen => 2,
                WorkerState::Draining => 3,
            };
            counts[i] += 1;
        }
        let [live, evicted, breaker_open, draining] = counts;
        if live + evicted + breaker_open + draining == 0 {
            let why = format!("no {role} worker is registered");
            return (RefusedReason::NoWorker, why);
        }
        let reason = if draining > 0 {
            RefusedReason::Draining
        } else if evicted > 0 {
            RefusedReason::Evicted
        } else if breaker_open > 0 {
            RefusedReason::BreakerOpen
        } else {
            RefusedReason::AllTried
        };
        let parts: Vec<String> = [
            (draining, "draining for shutdown"),
            (evicted, "evicted after failed health probes"),
            (breaker_open, "refused by an open circuit breaker"),
            (live, "live but already tried"),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        let why = format!(
            "no healthy {role} worker is available: {}",
            parts.join(", ")
        );
        (reason, why)
    }
}

impl Registry {
    /// The 503 for a request no worker of `role` can take, counted by its reason.
    pub fn refuse(&self, role: WorkerRole) -> ApiError {
        let (reason, message) = self.snapshot().refusal(role);
        self.count_refused(role, reason);
        ApiError::service_unavailable(message)
    }

    /// The 503 for a request that no mode can serve ([`Roster::routing_mode`] is
    /// unavailable), `what` saying what the request needs; each missing role's refusal
    /// is counted.
    pub fn refuse_unservable(&self, what: &str) -> ApiError {
        let roster = self.snapshot();
        let missing = roster.missing_roles(|role| !roster.routable(role).workers.is_empty());
        let why: Vec<String> = missing
            .into_iter()
            .map(|role| {
                let (reason, message) = roster.refusal(role);
                self.count_refused(role, reason);
                message
            })
            .collect();
        ApiError::service_unavailable(format!("{what}: {}", why.join("; ")))
    }

    /// [`Registry::refuse`] for a request any of `roles` could serve (`/v1/models`,
    /// `/tokenize`): names the first of them that has workers registered.
    pub fn refuse_any(&self, roles: &[WorkerRole]) -> ApiError {
        let roster = self.snapshot();
        let registered =
            |role: &WorkerRole| roster.members().iter().any(|m| m.worker.role() == *role);
        let role = roles
            .iter()
            .copied()
            .find(registered)
            .or(roles.first().copied());
        self.refuse(role.unwrap_or(WorkerRole::Decode))
    }

    /// Counts a request refused because no worker of `role` could take it.
    pub fn count_refused(&self, role: WorkerRole, reason: RefusedReason) {
        self.metrics.inc_refused(role.as_str(), reason.as_str());
    }
}
