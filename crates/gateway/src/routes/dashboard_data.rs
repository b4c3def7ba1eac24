//! `GET /dashboard/data`: what the page draws, as JSON. The shape is documented field by
//! field in docs/operations.md ("Dashboard") and kept stable: fields are added, never renamed.

use std::time::UNIX_EPOCH;

use pdserve_protocol::WorkerRole;
use serde::Serialize;

use crate::fleet::registry::{CircuitState, Health, Member, WorkerSource};
use crate::observe::history::Sample;
use crate::observe::request_record::{Hop, Mode, RequestRecord};
use crate::serving::{Protocol, Serving};

/// The whole answer of `/dashboard/data`.
#[derive(Debug, Serialize)]
pub struct DashboardData {
    /// The gateway itself.
    pub gateway: GatewaySummary,
    /// Every registered worker, live and evicted.
    pub workers: Vec<WorkerRow>,
    /// One per completed second, oldest first (at most the last 300).
    pub samples: Vec<Sample>,
    /// The last finished generation requests, newest first (at most 50).
    pub requests: Vec<RequestRow>,
}

/// The gateway's own facts.
#[derive(Debug, Serialize)]
pub struct GatewaySummary {
    /// pdserve's version.
    pub version: &'static str,
    /// Unix milliseconds when this answer was made.
    pub now_ms: u64,
    /// What the roster can serve: `disaggregated`, `aggregated` or `unavailable`.
    pub mode: &'static str,
    /// The P/D handoff protocol: `vllm` or `sglang`.
    pub protocol: &'static str,
    /// The routing policy per role.
    pub policies: Policies,
    /// `cache_aware` prefix-match hit ratio per role, where that policy routes the role.
    pub policy_cache_hit_ratio: PolicyRatios,
}

/// A value per worker role.
#[derive(Debug, Serialize)]
pub struct PerRole<T> {
    /// For prefill workers.
    pub prefill: T,
    /// For decode workers.
    pub decode: T,
    /// For prefill_decode workers.
    pub prefill_decode: T,
}

impl<T> PerRole<T> {
    fn of(f: impl Fn(WorkerRole) -> T) -> Self {
        Self {
            prefill: f(WorkerRole::Prefill),
            decode: f(WorkerRole::Decode),
            prefill_decode: f(WorkerRole::PrefillDecode),
        }
    }
}

/// The routing policy per role.
pub type Policies = PerRole<&'static str>;
/// `cache_aware` hit ratios per role (`null` where another policy routes).
pub type PolicyRatios = PerRole<Option<f64>>;

/// One roster row.
#[derive(Debug, Serialize)]
pub struct WorkerRow {
    /// Base URL.
    pub url: String,
    /// `prefill`, `decode`, `prefill_decode` or `encode`.
    pub role: WorkerRole,
    /// Where it came from: `static`, `registration`, `file`, `dns`, `kubernetes`.
    pub source: WorkerSource,
    /// `live` or `evicted`.
    pub health: Health,
    /// `closed`, `open` or `half_open`.
    pub circuit: CircuitState,
    /// This gateway's requests open on it.
    pub in_flight: i64,
    /// The load routing balances on (reported queue plus requests sent since, else
    /// in-flight).
    pub load: i64,
    /// Requests it reported waiting (its `/metrics`), while the report is fresh.
    pub waiting: Option<f64>,
    /// Requests it reported running.
    pub running: Option<f64>,
    /// Share of its KV cache in use, 0-1.
    pub kv_usage: Option<f64>,
    /// Its prefix-cache hit ratio, 0-1 (hit over queried prompt tokens since it started,
    /// from vLLM's `prefix_cache_hits`/`queries` counters or SGLang's `cache_hit_rate`).
    pub prefix_cache_hit_ratio: Option<f64>,
    /// Consecutive failed probes or connections.
    pub consecutive_failures: u32,
}

/// One finished request.
#[derive(Debug, Serialize)]
pub struct RequestRow {
    /// Unix milliseconds when it finished.
    pub finished_ms: u64,
    /// Its `X-Request-Id`.
    pub request_id: String,
    /// The client route.
    pub endpoint: &'static str,
    /// How it crossed the workers: `aggregated`, `vllm_pd`, `sglang_pd`,
    /// `prefill_skipped`, `e_p_d`, `e_pd` or `unrouted`.
    pub mode: &'static str,
    /// The prefill worker that served it.
    pub prefill: Option<HopRow>,
    /// The decode worker that answered.
    pub decode: Option<HopRow>,
    /// The prefill_decode worker that answered.
    pub worker: Option<HopRow>,
    /// The status the client got; for a stream that failed after its head, its error
    /// event's status; 499 when the client left mid-stream.
    pub status: u16,
    /// `ok`, `error`, `stream_error` or `client_left`.
    pub outcome: &'static str,
    /// Whether it was streamed.
    pub stream: bool,
    /// A stream's time to its first byte to the client, ms.
    pub ttft_ms: Option<f64>,
    /// A stream's mean gap between chunks after the first, ms.
    pub itl_ms: Option<f64>,
    /// Arrival to the end of the answer, ms.
    pub duration_ms: f64,
}

/// A worker on a request's route.
#[derive(Debug, Serialize)]
pub struct HopRow {
    /// Its base URL.
    pub url: String,
    /// What it held of the prompt when chosen (`--expose-routing` only).
    pub cache: Option<CacheRow>,
    /// Its predicted time to first token when chosen, ms (`--policy slo` with
    /// `--expose-routing`).
    pub predicted_ttft_ms: Option<f64>,
    /// Its predicted time per output token when chosen, ms.
    pub predicted_tpot_ms: Option<f64>,
}

/// A prefix match.
#[derive(Debug, Serialize)]
pub struct CacheRow {
    /// How the policy knew: `events` (the worker's KV events) or `approximate`.
    pub source: &'static str,
    /// Length of the prompt's start the worker held.
    pub matched: usize,
    /// The prompt's length.
    pub prompt: usize,
    /// `tokens` or `chars`.
    pub unit: &'static str,
}

impl DashboardData {
    /// The dashboard's view of `state` now.
    pub fn collect(state: &Serving) -> Self {
        let roster = state.registry.snapshot();
        let history = state.metrics.history();
        let disaggregated = match state.settings.protocol {
            Protocol::Vllm => "vllm_pd",
            Protocol::Sglang => "sglang_pd",
        };
        let ratio = |role| {
            let policy = state.policy(role);
            (policy.name() == "cache_aware").then(|| {
                let stats = policy.stats();
                let decided = stats.cache_hits + stats.cache_misses;
                (decided > 0).then(|| stats.cache_hits as f64 / decided as f64)
            })?
        };
        Self {
            gateway: GatewaySummary {
                version: env!("CARGO_PKG_VERSION"),
                now_ms: UNIX_EPOCH.elapsed().unwrap_or_default().as_millis() as u64,
                mode: roster.mode().as_str(),
                protocol: match state.settings.protocol {
                    Protocol::Vllm => "vllm",
                    Protocol::Sglang => "sglang",
                },
                policies: PerRole::of(|role| state.policy(role).name()),
                policy_cache_hit_ratio: PerRole::of(ratio),
            },
            workers: roster.members().iter().map(worker_row).collect(),
            samples: history.samples(),
            requests: history
                .recent_requests()
                .iter()
                .map(|r| request_row(r, disaggregated))
                .collect(),
        }
    }
}

fn worker_row(member: &Member) -> WorkerRow {
    let w = &member.worker;
    let reported = w.reported_load();
    WorkerRow {
        url: w.base.clone(),
        role: w.role(),
        source: member.source,
        health: member.health,
        circuit: w.circuit(),
        in_flight: w.in_flight(),
        load: w.load(),
        waiting: reported.map(|r| r.waiting),
        running: reported.map(|r| r.running),
        kv_usage: reported.and_then(|r| r.kv_usage),
        prefix_cache_hit_ratio: reported.and_then(|r| r.prefix_cache_hit_ratio),
        consecutive_failures: w.failures(),
    }
}

fn request_row(r: &RequestRecord, disaggregated: &'static str) -> RequestRow {
    let f = &r.finished;
    let ms = |d: std::time::Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    RequestRow {
        finished_ms: r
            .finished_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64,
        request_id: r.request_id.to_str().unwrap_or("<non-ascii>").to_string(),
        endpoint: r.endpoint,
        mode: match r.mode {
            Mode::Unrouted => "unrouted",
            Mode::Aggregated => "aggregated",
            Mode::Disaggregated => disaggregated,
            Mode::PrefillSkipped => "prefill_skipped",
            Mode::EncodePrefillDecode => "e_p_d",
            Mode::EncodePrefillDecodeTogether => "e_pd",
        },
        prefill: r.prefill.as_ref().map(hop_row),
        decode: r.decode.as_ref().map(hop_row),
        worker: r.worker.as_ref().map(hop_row),
        status: f.status,
        outcome: f.outcome,
        stream: f.stream,
        ttft_ms: f.ttft.map(ms),
        itl_ms: f.itl.map(ms),
        duration_ms: ms(f.duration),
    }
}

fn hop_row(hop: &Hop) -> HopRow {
    HopRow {
        url: hop.worker.base.clone(),
        cache: hop.cache.map(|c| CacheRow {
            source: match c.source {
                crate::policy::MatchSource::Events => "events",
                crate::policy::MatchSource::Approximate => "approximate",
            },
            matched: c.matched,
            prompt: c.prompt_len,
            unit: if c.tokens { "tokens" } else { "chars" },
        }),
        predicted_ttft_ms: hop.forecast.and_then(|f| f.ttft),
        predicted_tpot_ms: hop.forecast.and_then(|f| f.tpot),
    }
}
