//! Per-request records and what they add up to: latency distributions, throughput,
//! failures and goodput.
//!
//! Definitions (the same as `vllm bench serve`):
//! - TTFT: send → first content chunk. E2E: send → `data: [DONE]`.
//! - TPOT: `(e2e - ttft) / (output_tokens - 1)`, for requests with more than one token.
//! - ITL: every gap between consecutive content chunks, pooled over all requests.
//! - Throughput: totals divided by the run's duration (first send → last answer).
//! - Goodput (DistServe): completed requests meeting every SLO given, per second of the
//!   run. A one-token answer has no TPOT and meets any TPOT SLO.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::client::{RequestError, StreamRecord};

/// One request as measured; a row of `requests` in the result file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the run (serve: dispatch order; multi-turn: conversation-major).
    pub index: u64,
    /// Multi-turn only: the conversation, from 0.
    pub conversation: Option<u64>,
    /// Multi-turn only: the turn, from 0.
    pub turn: Option<u64>,
    /// Send time, seconds from the start of the run.
    pub start_s: f64,
    /// Open loop (request rate, trace): the planned send time, seconds from the start of
    /// the run; `None` in a closed loop, and absent in files written before it.
    #[serde(default)]
    pub scheduled_s: Option<f64>,
    /// Whether the request completed.
    pub ok: bool,
    /// The failure reason, when it did not.
    pub error: Option<String>,
    /// The HTTP status of a failure the server answered with one (429 and 408 are an
    /// overloaded gateway's rejections); absent in files written before `--priority`.
    #[serde(default)]
    pub http_status: Option<u16>,
    /// serve `--priority`: the `priority` this request sent (`None`: none); absent in
    /// files written before the option existed.
    #[serde(default)]
    pub priority: Option<i64>,
    /// Prompt tokens the benchmark built (before BOS or a chat template).
    pub requested_prompt_tokens: u64,
    /// `max_tokens` asked for.
    pub requested_output_tokens: u64,
    /// Prompt tokens as the server's `usage` reports them.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// Output tokens (from `usage`, else the number of content chunks); 0 on failure.
    pub output_tokens: u64,
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, ms.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<f64>,
    /// Gaps between consecutive content chunks, ms.
    pub itl_ms: Vec<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl RequestRecord {
    /// A record from the outcome of one request sent at `start` into the run.
    pub fn new(
        index: u64,
        start: Duration,
        requested_prompt_tokens: u64,
        requested_output_tokens: u64,
        outcome: &Result<StreamRecord, RequestError>,
    ) -> Self {
        let mut record = Self {
            index,
            conversation: None,
            turn: None,
            start_s: start.as_secs_f64(),
            scheduled_s: None,
            ok: outcome.is_ok(),
            error: None,
            http_status: None,
            priority: None,
            requested_prompt_tokens,
            requested_output_tokens,
            prompt_tokens: None,
            cached_tokens: None,
            output_tokens: 0,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: None,
            itl_ms: Vec::new(),
        };
        match outcome {
            Ok(r) => {
                record.prompt_tokens = r.usage.as_ref().map(|u| u.prompt_tokens);
                record.cached_tokens = r
                    .usage
                    .as_ref()
                    .and_then(|u| u.prompt_tokens_details.as_ref())
                    .map(|d| d.cached_tokens);
                record.output_tokens = r.output_tokens();
                record.ttft_ms = Some(ms(r.ttft));
                record.tpot_ms = r.tpot().map(ms);
                record.e2e_ms = Some(ms(r.e2e));
                record.itl_ms = r.inter_token_latencies().into_iter().map(ms).collect();
            }
            Err(e) => {
                record.error = Some(e.to_string());
                if let RequestError::Status { status, .. } = e {
                    record.http_status = Some(*status);
                }
            }
        }
        record
    }

    /// How late the bench sent this request: send time minus planned send time, ms
    /// (open loop only). The timer never fires early, so it is not negative.
    pub fn send_lateness_ms(&self) -> Option<f64> {
        self.scheduled_s
            .map(|planned| ((self.start_s - planned) * 1e3).max(0.0))
    }

    /// Prompt tokens: the server's count when given, else the requested count.
    pub fn input_tokens(&self) -> u64 {
        self.prompt_tokens.unwrap_or(self.requested_prompt_tokens)
    }

    /// Whether this completed request meets every SLO that is set.
    pub fn meets(&self, slo: &Slo) -> bool {
        let ttft_ok = match (slo.ttft_ms, self.ttft_ms) {
            (Some(limit), Some(v)) => v <= limit,
            (Some(_), None) => false,
            (None, _) => true,
        };
        let tpot_ok = match slo.tpot_ms {
            Some(limit) => self.tpot_ms.unwrap_or(0.0) <= limit,
            None => true,
        };
        self.ok && ttft_ok && tpot_ok
    }
}

/// Service-level objectives, in ms; `None` means no objective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Limit on TTFT.
    pub ttft_ms: Option<f64>,
    /// Limit on TPOT.
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// Whether any objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }
}

/// Summary statistics of a latency, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Distribution {
    /// Statistics of `samples`; `None` when there are none.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
        })
    }
}

/// The `p`th percentile of sorted samples, interpolating linearly between ranks (the
/// numpy default, so numbers match vLLM's reports).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = (p / 100.0) * (sorted.len() - 1) as f64;
    let low = rank.floor() as usize;
    let high = rank.ceil() as usize;
    sorted[low] + (sorted[high] - sorted[low]) * (rank - low as f64)
}

/// How many requests failed for one reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureCount {
    /// The failure reason.
    pub reason: String,
    /// Requests that failed for it.
    pub count: u64,
}

/// Everything a run adds up to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Requests never sent or cut off by Ctrl-C.
    pub not_finished: u64,
    /// First send to last answer (or to the interruption), seconds.
    pub duration_s: f64,
    /// Prompt tokens of completed requests (server counts where reported).
    pub total_input_tokens: u64,
    /// Output tokens of completed requests.
    pub total_output_tokens: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt plus output tokens per second.
    pub total_token_throughput: f64,
    /// Completed requests meeting every SLO; `null` when no SLO was given.
    pub good_requests: Option<u64>,
    /// `good_requests` per second; `null` when no SLO was given.
    pub goodput: Option<f64>,
    /// Cached prompt tokens over prompt tokens, for requests whose usage reports both.
    pub cached_token_share: Option<f64>,
    /// Time to first token.
    pub ttft_ms: Option<Distribution>,
    /// Time per output token after the first.
    pub tpot_ms: Option<Distribution>,
    /// Inter-token latency (all gaps pooled).
    pub itl_ms: Option<Distribution>,
    /// End-to-end latency.
    pub e2e_ms: Option<Distribution>,
    /// Open loop: how late the bench sent its requests (send time minus planned send
    /// time), over every request sent; `None` in a closed loop and in files written
    /// before it. A high p99 means the client, not the server, shaped the load.
    #[serde(default)]
    pub send_lateness_ms: Option<Distribution>,
}

/// The share of prompt tokens served from cache, over records reporting it.
pub fn cached_share<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> Option<f64> {
    let (cached, prompt) = records
        .into_iter()
        .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
        .fold((0u64, 0u64), |(c, p), (rc, rp)| (c + rc, p + rp));
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

/// Adds up `records` of a run that lasted `duration` and planned `planned` requests.
pub fn summarize(
    records: &[RequestRecord],
    planned: u64,
    duration: Duration,
    slo: &Slo,
) -> Summary {
    let done: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let secs = duration.as_secs_f64().max(f64::MIN_POSITIVE);
    let total_input_tokens = done.iter().map(|r| r.input_tokens()).sum::<u64>();
    let total_output_tokens = done.iter().map(|r| r.output_tokens).sum::<u64>();
    let good_requests = slo
        .is_set()
        .then(|| done.iter().filter(|r| r.meets(slo)).count() as u64);
    let collect = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        done.iter().filter_map(|r| f(r)).collect()
    };
    let itl: Vec<f64> = done.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    Summary {
        completed: done.len() as u64,
        failed: (records.len() - done.len()) as u64,
        not_finished: planned.saturating_sub(records.len() as u64),
        duration_s: duration.as_secs_f64(),
        total_input_tokens,
        total_output_tokens,
        request_throughput: done.len() as f64 / secs,
        output_throughput: total_output_tokens as f64 / secs,
        total_token_throughput: (total_input_tokens + total_output_tokens) as f64 / secs,
        good_requests,
        goodput: good_requests.map(|g| g as f64 / secs),
        cached_token_share: cached_share(done.iter().copied()),
        ttft_ms: Distribution::of(&collect(|r| r.ttft_ms)),
        tpot_ms: Distribution::of(&collect(|r| r.tpot_ms)),
        itl_ms: Distribution::of(&itl),
        e2e_ms: Distribution::of(&collect(|r| r.e2e_ms)),
        // Failed requests were sent too: lateness is the client's, whatever the answer.
        send_lateness_ms: Distribution::of(
            &records
                .iter()
                .filter_map(RequestRecord::send_lateness_ms)
                .collect::<Vec<_>>(),
        ),
    }
}

/// Failures grouped by reason, most frequent first.
pub fn failures(records: &[RequestRecord]) -> Vec<FailureCount> {
    let mut by_reason: BTreeMap<&str, u64> = BTreeMap::new();
    for reason in records.iter().filter_map(|r| r.error.as_deref()) {
        *by_reason.entry(reason).or_default() += 1;
    }
    let mut out: Vec<FailureCount> = by_reason
        .into_iter()
        .map(|(reason, count)| FailureCount {
            reason: reason.to_string(),
            count,
        })
        .collect();
    out.sort_by_key(|f| std::cmp::Reverse(f.count));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft: f64, tpot: Option<f64>, ok: bool) -> RequestRecord {
        RequestRecord {
            index: 0,
            conversation: None,
            turn: None,
            start_s: 0.0,
            scheduled_s: None,
            ok,
            error: (!ok).then(|| "HTTP 503: busy".to_string()),
            http_status: (!ok).then_some(503),
            priority: None,
            requested_prompt_tokens: 10,
            requested_output_tokens: 5,
            prompt_tokens: Some(11),
            cached_tokens: Some(4),
            output_tokens: if ok { 5 } else { 0 },
            ttft_ms: ok.then_some(ttft),
            tpot_ms: if ok { tpot } else { None },
            e2e_ms: ok.then_some(ttft + 40.0),
            itl_ms: if ok { vec![10.0; 4] } else { vec![] },
        }
    }

    #[test]
    fn failures_keep_the_http_status_they_were_answered() {
        let rejected: Result<StreamRecord, RequestError> = Err(RequestError::Status {
            status: 429,
            message: "queue full".into(),
        });
        let r = RequestRecord::new(0, Duration::ZERO, 1, 1, &rejected);
        assert_eq!((r.ok, r.http_status), (false, Some(429)));
        assert_eq!(r.error.as_deref(), Some("HTTP 429: queue full"));
        let timed_out: Result<StreamRecord, RequestError> = Err(RequestError::Timeout(1.0));
        let r = RequestRecord::new(0, Duration::ZERO, 1, 1, &timed_out);
        assert_eq!(
            r.http_status, None,
            "a client-side timeout is no HTTP answer"
        );
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let d = Distribution::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((d.min, d.max, d.mean), (1.0, 4.0, 2.5));
        assert!((d.p50 - 2.5).abs() < 1e-12);
        assert!((d.p90 - 3.7).abs() < 1e-12);
        assert!((d.p99 - 3.97).abs() < 1e-12);
        assert_eq!(Distribution::of(&[7.0]).unwrap().p99, 7.0);
        assert!(Distribution::of(&[]).is_none());
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let records = vec![
            record(50.0, Some(10.0), true),  // good
            record(500.0, Some(10.0), true), // slow first token
            record(50.0, Some(90.0), true),  // slow decode
            record(50.0, None, true),        // one token: no TPOT, meets the TPOT SLO
            record(0.0, None, false),        // failed: never good
        ];
        let both = Slo {
            ttft_ms: Some(100.0),
            tpot_ms: Some(50.0),
        };
        let s = summarize(&records, 6, Duration::from_secs(2), &both);
        assert_eq!(s.good_requests, Some(2));
        assert_eq!(s.goodput, Some(1.0));
        assert_eq!((s.completed, s.failed, s.not_finished), (4, 1, 1));
        assert_eq!(s.total_input_tokens, 44);
        assert_eq!(s.total_output_tokens, 20);
        assert_eq!(s.output_throughput, 10.0);
        assert_eq!(s.cached_token_share, Some(4.0 / 11.0));
        let ttft_only = Slo {
            ttft_ms: Some(100.0),
            tpot_ms: None,
        };
        assert_eq!(
            summarize(&records, 5, Duration::from_secs(1), &ttft_only).good_requests,
            Some(3)
        );
        assert_eq!(
            summarize(&records, 5, Duration::from_secs(1), &Slo::default()).goodput,
            None
        );
        assert_eq!(
            failures(&records),
            vec![FailureCount {
                reason: "HTTP 503: busy".into(),
                count: 1
            }]
        );
    }
}
