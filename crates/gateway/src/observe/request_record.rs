//! What the dashboard keeps of one request: how it crossed the workers, which ones served
//! it, and how it ended. Plain data, written by the request's [`super::journey::Journey`]
//! and kept by the [`super::history::History`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::fleet::registry::Worker;
use crate::policy::CacheMatch;

/// How a request crossed the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No worker answered (refused, failed before routing, or every leg failed).
    Unrouted,
    /// One prefill_decode worker.
    Aggregated,
    /// A prefill worker, then a decode worker (vLLM's or SGLang's handoff: the gateway's
    /// `--protocol` says which).
    Disaggregated,
    /// A short uncached prompt sent straight to a decode worker (`--disagg-threshold`).
    PrefillSkipped,
    /// Encoders, then prefill and decode workers.
    EncodePrefillDecode,
    /// Encoders, then a prefill_decode worker.
    EncodePrefillDecodeTogether,
}

/// A worker that served one part of a request, and what it held of the prompt when
/// chosen (known with `--expose-routing`, which keeps the policies' notes).
#[derive(Debug, Clone)]
pub struct Hop {
    /// The worker.
    pub worker: Arc<Worker>,
    /// Its cached share of the prompt when chosen.
    pub cache: Option<CacheMatch>,
    /// What it was predicted to give the request when chosen (`--policy slo`).
    pub forecast: Option<crate::policy::predictor::Forecast>,
}

/// How a finished request went, for the request table and the second's counts.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The HTTP status the client got; for a stream that failed after its head, the
    /// status of the error event it ended with (499: the client left).
    pub status: u16,
    /// `ok`, `error` (a status ≥ 400), `stream_error` (failed after the first byte) or
    /// `client_left` (the client closed the connection mid-stream).
    pub outcome: &'static str,
    /// Whether the answer was streamed.
    pub stream: bool,
    /// A stream's time from arrival to its first byte to the client.
    pub ttft: Option<Duration>,
    /// A stream's mean gap between upstream chunks after the first.
    pub itl: Option<Duration>,
    /// Arrival to the end of the answer.
    pub duration: Duration,
}

/// One finished request as the request table shows it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// When it finished.
    pub finished_at: SystemTime,
    /// Its `X-Request-Id`.
    pub request_id: http::HeaderValue,
    /// The client route (`/v1/chat/completions`, ...).
    pub endpoint: &'static str,
    /// How it crossed the workers.
    pub mode: Mode,
    /// The prefill worker that served it.
    pub prefill: Option<Hop>,
    /// The decode worker that answered.
    pub decode: Option<Hop>,
    /// The prefill_decode worker that answered.
    pub worker: Option<Hop>,
    /// How it ended.
    pub finished: Finished,
    /// The latency objectives it was served to.
    pub slo: crate::ingress::slo::Slo,
}

impl RequestRecord {
    /// Whether it met its TTFT and its TPOT objective (`None` for one it had not; a
    /// request that failed met neither; a body has no TTFT to compare and is not
    /// counted for it).
    pub fn attained(&self) -> (Option<bool>, Option<bool>) {
        let f = &self.finished;
        let ok = f.outcome == "ok";
        let within = |goal: Option<Duration>, actual: Option<Duration>| match (goal, actual) {
            (None, _) => None,
            (Some(_), _) if !ok => Some(false),
            (Some(goal), Some(actual)) => Some(actual <= goal),
            (Some(_), None) => None,
        };
        (within(self.slo.ttft, f.ttft), within(self.slo.tpot, f.itl))
    }
}
