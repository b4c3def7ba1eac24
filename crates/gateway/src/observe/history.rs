//! The dashboard's bounded memory of recent traffic: one sample per second (requests,
//! errors and latency percentiles) for the last [`SAMPLE_SECONDS`], and the last
//! [`RECENT_REQUESTS`] finished requests with the route each took.
//!
//! The request path pays for it with atomic increments into the running second's
//! histograms and, once per finished request, one short-locked push into a ring that
//! never grows past its capacity; the second's percentiles are computed when the next
//! second begins (by whichever request or `/dashboard/data` read sees it first).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::request_record::RequestRecord;

/// Seconds of per-second samples kept (the charts' span).
pub const SAMPLE_SECONDS: usize = 300;
/// Finished requests kept for the "last requests" table.
pub const RECENT_REQUESTS: usize = 50;

/// Histogram buckets per series: bucket 0 holds everything under [`FIRST_BOUND_US`],
/// bucket `i` the durations in `[FIRST_BOUND_US·GROWTH^(i-1), FIRST_BOUND_US·GROWTH^i)`;
/// 0.1 ms to about an hour, each bucket 20% wider than the last (a percentile is
/// reported within 10%).
const BUCKETS: usize = 96;
const FIRST_BOUND_US: f64 = 100.0;
const GROWTH: f64 = 1.2;

/// The latency series charted per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Series {
    /// Client time to first token (a stream's first byte to the client).
    Ttft,
    /// Mean gap between a stream's chunks after the first, per request.
    Itl,
    /// Prefill leg, sent to answer read.
    Prefill,
    /// Decode (or aggregated) leg, sent to its first byte.
    DecodeTtfb,
    /// Arrival to the last byte of the answer.
    EndToEnd,
}

const SERIES: usize = 5;

/// One histogram of the running second.
struct Buckets([AtomicU32; BUCKETS]);

impl Buckets {
    fn new() -> Self {
        Self(std::array::from_fn(|_| AtomicU32::new(0)))
    }

    fn observe(&self, d: Duration) {
        self.0[bucket_of(d)].fetch_add(1, Ordering::Relaxed);
    }

    /// Takes the counts out, leaving zeros.
    fn drain(&self) -> [u32; BUCKETS] {
        std::array::from_fn(|i| self.0[i].swap(0, Ordering::Relaxed))
    }
}

fn bucket_of(d: Duration) -> usize {
    let us = d.as_secs_f64() * 1e6;
    if us < FIRST_BOUND_US {
        return 0;
    }
    let i = ((us / FIRST_BOUND_US).ln() / GROWTH.ln()).floor() as usize + 1;
    i.min(BUCKETS - 1)
}

/// A bucket's representative value in milliseconds: its geometric middle.
fn bucket_ms(i: usize) -> f64 {
    if i == 0 {
        return FIRST_BOUND_US / 2.0 / 1000.0;
    }
    let low = FIRST_BOUND_US * GROWTH.powi(i as i32 - 1);
    low * GROWTH.sqrt() / 1000.0
}

/// p50, p90 and p99 of one second, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Observations behind them.
    pub count: u32,
}

fn percentiles(counts: &[u32; BUCKETS]) -> Option<Percentiles> {
    let total: u64 = counts.iter().map(|&c| c as u64).sum();
    if total == 0 {
        return None;
    }
    let at = |q: f64| {
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, &c) in counts.iter().enumerate() {
            seen += c as u64;
            if seen >= rank {
                return round_ms(bucket_ms(i));
            }
        }
        round_ms(bucket_ms(BUCKETS - 1))
    };
    Some(Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
        count: total as u32,
    })
}

/// Milliseconds to 3 significant decimals (the JSON stays short).
fn round_ms(ms: f64) -> f64 {
    (ms * 1000.0).round() / 1000.0
}

/// One second of traffic as the charts draw it.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The second's start, Unix milliseconds.
    pub t_ms: u64,
    /// Generation requests that finished in it (answered, failed or abandoned).
    pub requests: u32,
    /// Of them, those that did not succeed (status ≥ 400, a stream that failed or that
    /// the client left).
    pub errors: u32,
    /// Client time to first token of the streams that finished in it.
    pub ttft_ms: Option<Percentiles>,
    /// Per-stream mean inter-chunk latency (≈ per output token).
    pub itl_ms: Option<Percentiles>,
    /// Prefill legs that finished in it.
    pub prefill_ms: Option<Percentiles>,
    /// Decode (or aggregated) legs' time to first byte.
    pub decode_ttfb_ms: Option<Percentiles>,
    /// End-to-end durations.
    pub e2e_ms: Option<Percentiles>,
    /// How many of the requests that finished in it met their objectives.
    pub slo: Attainment,
}

/// Requests with an objective that met or missed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Attainment {
    /// Met their TTFT objective.
    pub ttft_met: u32,
    /// Missed it (or failed).
    pub ttft_missed: u32,
    /// Met their TPOT objective.
    pub tpot_met: u32,
    /// Missed it (or failed).
    pub tpot_missed: u32,
}

impl Attainment {
    /// The shares that met their TTFT and TPOT objectives (`None` without any).
    pub fn shares(&self) -> (Option<f64>, Option<f64>) {
        let share = |met: u32, missed: u32| {
            (met + missed > 0).then(|| f64::from(met) / f64::from(met + missed))
        };
        (
            share(self.ttft_met, self.ttft_missed),
            share(self.tpot_met, self.tpot_missed),
        )
    }

    /// Both counts together.
    pub fn add(&mut self, other: &Attainment) {
        self.ttft_met += other.ttft_met;
        self.ttft_missed += other.ttft_missed;
        self.tpot_met += other.tpot_met;
        self.tpot_missed += other.tpot_missed;
    }
}

/// The running second's accumulators.
struct Window {
    requests: AtomicU32,
    errors: AtomicU32,
    series: [Buckets; SERIES],
    /// TTFT met, TTFT missed, TPOT met, TPOT missed.
    slo: [AtomicU32; 4],
}

/// Per-second samples and recent requests (see the module documentation).
pub struct History {
    /// The clock's origin: seconds are counted from it, and `origin_unix` names it.
    origin: Instant,
    origin_unix: Duration,
    /// The second (since `origin`) that `window` accumulates.
    second: AtomicU64,
    window: Window,
    samples: Mutex<VecDeque<Sample>>,
    requests: Mutex<VecDeque<RequestRecord>>,
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History").finish_non_exhaustive()
    }
}

impl Default for History {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            origin_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
            second: AtomicU64::new(0),
            window: Window {
                requests: AtomicU32::new(0),
                errors: AtomicU32::new(0),
                series: std::array::from_fn(|_| Buckets::new()),
                slo: std::array::from_fn(|_| AtomicU32::new(0)),
            },
            samples: Mutex::new(VecDeque::with_capacity(SAMPLE_SECONDS)),
            requests: Mutex::new(VecDeque::with_capacity(RECENT_REQUESTS)),
        }
    }
}

impl History {
    /// Adds one observation of `series` to the running second.
    pub fn observe(&self, series: Series, d: Duration) {
        self.roll();
        self.window.series[series as usize].observe(d);
    }

    /// Records a finished request: counted in the running second, its latencies
    /// observed, and kept in the request ring (the oldest one dropped).
    pub fn finish(&self, record: RequestRecord) {
        self.roll();
        let f = &record.finished;
        self.window.requests.fetch_add(1, Ordering::Relaxed);
        if f.outcome != "ok" {
            self.window.errors.fetch_add(1, Ordering::Relaxed);
        }
        let series = &self.window.series;
        series[Series::EndToEnd as usize].observe(f.duration);
        if let Some(ttft) = f.ttft {
            series[Series::Ttft as usize].observe(ttft);
        }
        if let Some(itl) = f.itl {
            series[Series::Itl as usize].observe(itl);
        }
        let (ttft, tpot) = record.attained();
        for (attained, met) in [(ttft, 0), (tpot, 2)] {
            if let Some(attained) = attained {
                let slot = if attained { met } else { met + 1 };
                self.window.slo[slot].fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut ring = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT_REQUESTS {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// The completed seconds, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.roll();
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.iter().cloned().collect()
    }

    /// The last finished requests, newest first.
    pub fn recent_requests(&self) -> Vec<RequestRecord> {
        let ring = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().cloned().collect()
    }

    /// When a new second has begun, closes the running one into a sample (and adds empty
    /// samples for quiet seconds in between). One caller wins the swap; the others go on
    /// adding to the window, which now counts for the new second.
    fn roll(&self) {
        let now = self.origin.elapsed().as_secs();
        let current = self.second.load(Ordering::Relaxed);
        if now <= current
            || self
                .second
                .compare_exchange(current, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let window = &self.window;
        let series: [[u32; BUCKETS]; SERIES] = std::array::from_fn(|i| window.series[i].drain());
        let closed = Sample {
            t_ms: self.unix_ms(current),
            requests: window.requests.swap(0, Ordering::Relaxed),
            errors: window.errors.swap(0, Ordering::Relaxed),
            ttft_ms: percentiles(&series[Series::Ttft as usize]),
            itl_ms: percentiles(&series[Series::Itl as usize]),
            prefill_ms: percentiles(&series[Series::Prefill as usize]),
            decode_ttfb_ms: percentiles(&series[Series::DecodeTtfb as usize]),
            e2e_ms: percentiles(&series[Series::EndToEnd as usize]),
            slo: Attainment {
                ttft_met: window.slo[0].swap(0, Ordering::Relaxed),
                ttft_missed: window.slo[1].swap(0, Ordering::Relaxed),
                tpot_met: window.slo[2].swap(0, Ordering::Relaxed),
                tpot_missed: window.slo[3].swap(0, Ordering::Relaxed),
            },
        };
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        push_bounded(&mut samples, closed);
        let quiet_from = (current + 1).max(now.saturating_sub(SAMPLE_SECONDS as u64));
        for second in quiet_from..now {
            push_bounded(&mut samples, self.empty(second));
        }
    }

    fn empty(&self, second: u64) -> Sample {
        Sample {
            t_ms: self.unix_ms(second),
            requests: 0,
            errors: 0,
            ttft_ms: None,
            itl_ms: None,
            prefill_ms: None,
            decode_ttfb_ms: None,
            e2e_ms: None,
            slo: Attainment::default(),
        }
    }

    fn unix_ms(&self, second: u64) -> u64 {
        (self.origin_unix + Duration::from_secs(second)).as_millis() as u64
    }
}

fn push_bounded(samples: &mut VecDeque<Sample>, sample: Sample) {
    if samples.len() == SAMPLE_SECONDS {
        samples.pop_front();
    }
    samples.push_back(sample);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::request_record::{Finished, Mode};

    #[test]
    fn percentiles_land_within_a_bucket_of_the_truth() {
        let buckets = Buckets::new();
        for ms in 1..=100 {
            buckets.observe(Duration::from_millis(ms));
        }
        let p = percentiles(&buckets.drain()).unwrap();
        assert_eq!(p.count, 100);
        for (got, want) in [(p.p50, 50.0), (p.p90, 90.0), (p.p99, 99.0)] {
            assert!((got - want).abs() / want < 0.12, "{got} vs {want}");
        }
        assert!(percentiles(&buckets.drain()).is_none(), "drained");
        assert_eq!(bucket_of(Duration::from_secs(100_000)), BUCKETS - 1);
        assert_eq!(bucket_of(Duration::ZERO), 0);
    }

    #[test]
    fn the_request_ring_keeps_the_newest() {
        let history = History::default();
        for i in 0..(RECENT_REQUESTS + 7) {
            history.finish(RequestRecord {
                finished_at: SystemTime::now(),
                request_id: http::HeaderValue::from_str(&i.to_string()).unwrap(),
                endpoint: "/v1/chat/completions",
                mode: Mode::Aggregated,
                prefill: None,
                decode: None,
                worker: None,
                finished: Finished {
                    status: 200,
                    outcome: "ok",
                    stream: false,
                    ttft: None,
                    itl: None,
                    duration: Duration::from_millis(3),
                },
                slo: Default::default(),
            });
        }
        let recent = history.recent_requests();
        assert_eq!(recent.len(), RECENT_REQUESTS);
        assert_eq!(recent[0].request_id, (RECENT_REQUESTS + 6).to_string());
    }

    #[test]
    fn attainment_counts_met_missed_and_failed_requests_per_objective() {
        let record = |outcome: &'static str, ttft_ms: u64, itl_ms: Option<u64>| RequestRecord {
            finished_at: SystemTime::now(),
            request_id: http::HeaderValue::from_static("r"),
            endpoint: "/v1/completions",
            mode: Mode::Aggregated,
            prefill: None,
            decode: None,
            worker: None,
            finished: Finished {
                status: if outcome == "ok" { 200 } else { 502 },
                outcome,
                stream: true,
                ttft: Some(Duration::from_millis(ttft_ms)),
                itl: itl_ms.map(Duration::from_millis),
                duration: Duration::from_millis(ttft_ms + 50),
            },
            slo: crate::ingress::slo::Slo {
                ttft: Some(Duration::from_millis(100)),
                tpot: Some(Duration::from_millis(20)),
            },
        };
        assert_eq!(
            record("ok", 80, Some(10)).attained(),
            (Some(true), Some(true))
        );
        assert_eq!(
            record("ok", 120, Some(30)).attained(),
            (Some(false), Some(false))
        );
        // One output token: no TPOT to compare.
        assert_eq!(record("ok", 80, None).attained(), (Some(true), None));
        assert_eq!(
            record("error", 80, Some(10)).attained(),
            (Some(false), Some(false))
        );
        let mut none = record("ok", 80, Some(10));
        none.slo = Default::default();
        assert_eq!(none.attained(), (None, None));

        let mut sum = Attainment::default();
        sum.add(&Attainment {
            ttft_met: 3,
            ttft_missed: 1,
            tpot_met: 0,
            tpot_missed: 0,
        });
        assert_eq!(sum.shares(), (Some(0.75), None));
    }
}
