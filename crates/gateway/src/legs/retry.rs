//! Retries of one leg before anything reached the client: each attempt goes to a fresh
//! worker (never one this request already tried), after an exponential backoff with
//! jitter; 4xx answers are final.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use pdserve_protocol::WorkerRole;

use crate::clients::worker_client::LegError;
use crate::clients::worker_client::LegFault;
use crate::error::Failure;
use crate::fleet::registry::{RefusedReason, Worker, WorkerState};
use crate::legs::RequestContext;
use crate::policy::RouteRequest;
use crate::serving::Serving;

/// First backoff; doubled per retry, with jitter, capped at [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(20);
/// Longest backoff between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Which leg a retry belongs to (metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// The prefill leg of a P/D request.
    Prefill,
    /// The leg that answers the client (decode or prefill_decode).
    Final,
}

impl Leg {
    /// The leg's metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Final => "decode",
        }
    }
}

/// One request's retry budget: `1 + --max-retries` attempts in all, whatever leg or
/// stage each attempt redoes, with an exponential backoff with jitter before each retry.
pub struct RetryBudget {
    attempts: usize,
    used: usize,
    backoff: backon::ExponentialBackoff,
}

impl RetryBudget {
    /// The budget `--max-retries` gives one request.
    pub fn new(state: &Serving) -> Self {
        Self {
            attempts: 1 + state.settings.max_retries as usize,
            used: 0,
            backoff: ExponentialBuilder::default()
                .with_min_delay(MIN_BACKOFF)
                .with_max_delay(MAX_BACKOFF)
                .with_jitter()
                .without_max_times()
                .build(),
        }
    }

    /// Whether an attempt is left.
    pub fn left(&self) -> bool {
        self.used < self.attempts
    }

    /// Attempts taken so far.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Takes the next attempt, after the backoff when it is a retry; `false` when the
    /// budget is spent.
    pub async fn take(&mut self) -> bool {
        if !self.left() {
            return false;
        }
        if self.used > 0 {
            if let Some(delay) = self.backoff.next() {
                tokio::time::sleep(delay).await;
            }
        }
        self.used += 1;
        true
    }
}

/// Runs `attempt` on a worker of `role` chosen by the policy, and again on fresh workers
/// while it fails in a retryable way, within the request's [`RetryBudget`]. Returns the
/// result and the worker that produced it.
pub async fn with_retries<T, F, Fut>(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    route: &RouteRequest<'_>,
    role: WorkerRole,
    leg: Leg,
    mut attempt: F,
) -> Result<(T, Arc<Worker>), Failure>
where
    F: FnMut(Arc<Worker>) -> Fut,
    Fut: Future<Output = Result<T, LegError>>,
{
    let mut budget = RetryBudget::new(state);
    let mut tried: Vec<Arc<Worker>> = Vec::new();
    let mut last: Option<LegError> = None;
    // What kept the last worker tried out of routing (panic routing tried it anyway).
    let mut last_state = WorkerState::Live;
    while budget.left() {
        let Some(worker) = state.pick(role, &tried, route) else {
            break;
        };
        if let Some(previous) = &last {
            state.metrics.inc_retries(
                leg.as_str(),
                crate::clients::worker_client::fault_label(previous.kind),
            );
            tracing::warn!(
                request_id = ctx.headers.request_id(),
                worker = %worker.base,
                reason = crate::clients::worker_client::fault_label(previous.kind),
                "retrying the {} leg on another worker",
                leg.as_str()
            );
        }
        budget.take().await;
        tried.push(worker.clone());
        last_state = worker.state();
        match attempt(worker.clone()).await {
            Ok(value) => {
                state.registry.record_answer(&worker);
                return Ok((value, worker));
            }
            Err(e) => {
                state.report(&worker, &e);
                if !e.retryable() {
                    return Err(e.failure);
                }
                last = Some(e);
            }
        }
    }
    Err(match last {
        Some(e) => {
            // A worker that panic routing tried refused the connection: no worker of the
            // role could take the request.
            if let (LegFault::Unreachable, Some(reason)) = (e.kind, RefusedReason::of(last_state)) {
                state.registry.count_refused(role, reason);
            }
            e.failure
        }
        None if tried.is_empty() => state.refuse(role).into(),
        None => unreachable!("an attempt that failed is recorded"),
    })
}
