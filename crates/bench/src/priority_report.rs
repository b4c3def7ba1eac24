//! Latency and rejections per `--priority` class, so an overload run shows whether the
//! stack really serves high-priority requests first and which class its queue rejects
//! (429) or times out (408).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::metrics::{Distribution, RequestRecord};
use crate::priority::PriorityMix;

/// Figures of one priority class; an entry of `per_priority` in the result file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrioritySummary {
    /// The class's `priority`; `null` for requests sent without one.
    pub priority: Option<i64>,
    /// Requests of this class that completed.
    pub completed: u64,
    /// Requests of this class that failed, rejections included.
    pub failed: u64,
    /// Failed requests answered HTTP 429 (an overloaded gateway's full queue).
    pub rejected_429: u64,
    /// Failed requests answered HTTP 408 (a gateway's queue wait ran out).
    pub rejected_408: u64,
    /// Time to first token of this class's completed requests.
    pub ttft_ms: Option<Distribution>,
    /// End-to-end latency of this class's completed requests.
    pub e2e_ms: Option<Distribution>,
}

/// One row per class of `mix`, in its order, then "none" if some requests carried no
/// priority; empty without `--priority`.
pub fn per_priority(records: &[RequestRecord], mix: &PriorityMix) -> Vec<PrioritySummary> {
    if mix.is_empty() {
        return Vec::new();
    }
    let mut classes: Vec<Option<i64>> = mix.classes().iter().map(|c| Some(c.value)).collect();
    if mix.remainder() > 0.0 || records.iter().any(|r| r.priority.is_none()) {
        classes.push(None);
    }
    classes
        .into_iter()
        .map(|priority| {
            let of_class: Vec<&RequestRecord> =
                records.iter().filter(|r| r.priority == priority).collect();
            let done: Vec<&RequestRecord> = of_class.iter().copied().filter(|r| r.ok).collect();
            let rejected = |status: u16| {
                of_class
                    .iter()
                    .filter(|r| !r.ok && r.http_status == Some(status))
                    .count() as u64
            };
            let ttft: Vec<f64> = done.iter().filter_map(|r| r.ttft_ms).collect();
            let e2e: Vec<f64> = done.iter().filter_map(|r| r.e2e_ms).collect();
            PrioritySummary {
                priority,
                completed: done.len() as u64,
                failed: (of_class.len() - done.len()) as u64,
                rejected_429: rejected(429),
                rejected_408: rejected(408),
                ttft_ms: Distribution::of(&ttft),
                e2e_ms: Distribution::of(&e2e),
            }
        })
        .collect()
}

/// Characters of a row of the "Per priority" section (the report widens to fit it).
pub(crate) const SECTION_WIDTH: usize = 78;

/// Appends the "Per priority" section of the report, `width` characters wide.
pub(crate) fn write_section(out: &mut String, rows: &[PrioritySummary], width: usize) {
    let _ = writeln!(out, "{:-^width$}", " Per priority (ms) ");
    let _ = writeln!(
        out,
        "{:>8} {:>6} {:>6} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "priority",
        "ok",
        "failed",
        "rej 429",
        "rej 408",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "E2E p99"
    );
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
    for r in rows {
        let _ = writeln!(
            out,
            "{:>8} {:>6} {:>6} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
            r.priority
                .map_or_else(|| "none".to_string(), |v| v.to_string()),
            r.completed,
            r.failed,
            r.rejected_429,
            r.rejected_408,
            ms(r.ttft_ms.map(|d| d.p50)),
            ms(r.ttft_ms.map(|d| d.p90)),
            ms(r.ttft_ms.map(|d| d.p99)),
            ms(r.e2e_ms.map(|d| d.p99)),
        );
    }
}
