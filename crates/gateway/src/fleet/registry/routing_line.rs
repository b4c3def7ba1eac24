//! What a routing decision reads of a worker, on one cache line and without a lock: its
//! id, this gateway's open requests on it, and its last reported load. A decision reads
//! these of every candidate (128 in a large pool), and each other line or lock it touched
//! per candidate was a memory miss the next candidate's could not overlap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

/// A worker's routing fields, 64-byte aligned so they share one line.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct RoutingLine {
    /// The worker's URL hashed ([`super::url_id`]).
    pub(super) id: u64,
    /// Open requests (shared with an updated record of the same URL, and exported).
    pub(super) in_flight: Gauge,
    /// The last report's waiting + running (high 32 bits) and this gateway's open
    /// requests when it came (low 32 bits), written together so they never mix.
    report: AtomicU64,
    /// Until when the report stands, in nanoseconds after [`epoch`]; 0: no report.
    until: AtomicU64,
}

/// The instant `until` counts from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn nanos_since_epoch(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

fn clamp_i32(v: i64) -> i32 {
    v.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32
}

impl RoutingLine {
    pub(super) fn new(id: u64, in_flight: Gauge) -> Self {
        Self {
            id,
            in_flight,
            report: AtomicU64::new(0),
            until: AtomicU64::new(0),
        }
    }

    /// Records a report of `load` (waiting + running) that came at `at` when this
    /// gateway had `in_flight_then` requests open there, standing for `valid_for`.
    pub(super) fn report(&self, load: i64, in_flight_then: i64, at: Instant, valid_for: Duration) {
        let packed =
            (u64::from(clamp_i32(load) as u32) << 32) | u64::from(clamp_i32(in_flight_then) as u32);
        self.report.store(packed, Ordering::Relaxed);
        // At least 1: 0 means no report.
        let until = nanos_since_epoch(at.checked_add(valid_for).unwrap_or(at)).max(1);
        self.until.store(until, Ordering::Relaxed);
    }

    /// Forgets the report.
    pub(super) fn clear(&self) {
        self.until.store(0, Ordering::Relaxed);
    }

    /// The reported load plus the requests opened since, while the report stands at
    /// `now`; the open requests alone otherwise.
    pub(super) fn load_at(&self, now: Instant) -> i64 {
        let in_flight = self.in_flight.get();
        let until = self.until.load(Ordering::Relaxed);
        if until == 0 || nanos_since_epoch(now) > until {
            return in_flight;
        }
        let packed = self.report.load(Ordering::Relaxed);
        let load = i64::from((packed >> 32) as u32 as i32);
        let then = i64::from(packed as u32 as i32);
        load + (in_flight - then).max(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_stands_for_its_time_and_counts_requests_opened_since() {
        let gauge = Gauge::default();
        let line = RoutingLine::new(7, gauge.clone());
        let now = Instant::now();
        gauge.set(2);
        assert_eq!(line.load_at(now), 2, "no report: the open requests");
        line.report(5, 2, now, Duration::from_secs(1));
        gauge.set(4);
        assert_eq!(line.load_at(now), 7, "5 reported, 2 opened since");
        gauge.set(1);
        assert_eq!(
            line.load_at(now),
            5,
            "closed since: not taken off the report"
        );
        assert_eq!(line.load_at(now + Duration::from_millis(999)), 5);
        assert_eq!(line.load_at(now + Duration::from_millis(1001)), 1, "stale");
        line.report(-3, i64::MAX, now, Duration::from_secs(1));
        assert_eq!(line.load_at(now), -3, "packed values keep their sign");
        line.clear();
        assert_eq!(line.load_at(now), 1);
        assert_eq!(std::mem::align_of::<RoutingLine>(), 64);
        assert!(std::mem::size_of::<RoutingLine>() <= 64);
    }
}
