//! Worker load from the workers themselves: every `--load-scrape-interval` each live
//! worker's `/metrics` is read for the requests it has waiting and running and its KV
//! usage — vLLM's `vllm:num_requests_waiting`, `vllm:num_requests_running`,
//! `vllm:kv_cache_usage_perc`, SGLang's `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs`, `sglang:token_usage` (pdserve workers export vLLM's names).
//! Every gateway replica reads the same numbers, so replicas balance alike;
//! [`Worker::load`](crate::fleet::registry::Worker::load) adds what this gateway sent since the
//! last report, and falls back to this gateway's in-flight count when a worker does not
//! answer or exports none of these.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry as MetricsRegistry;
use tokio::task::JoinHandle;

use crate::fleet::registry::{Registry, Worker};

/// Gauges read as the worker's waiting requests.
const WAITING: &[&str] = &["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
/// Gauges read as its running requests.
const RUNNING: &[&str] = &["vllm:num_requests_running", "sglang:num_running_reqs"];
/// Gauges read as its KV usage (0-1).
const KV_USAGE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// Counters read as prompt tokens found in the prefix cache (vLLM ≥ 0.10, and older).
const PREFIX_HITS: &[&str] = &[
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
];
/// Counters read as prompt tokens looked up in the prefix cache.
const PREFIX_QUERIES: &[&str] = &[
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
];
/// Gauges read as the prefix-cache hit ratio itself (0-1).
const PREFIX_HIT_RATE: &[&str] = &["sglang:cache_hit_rate"];

/// A worker's load as one scrape read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scraped {
    /// Requests waiting (summed over the worker's label sets: engines, models).
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV usage, the highest of its label sets.
    pub kv_usage: Option<f64>,
    /// Prefix-cache hits over lookups since the worker started (shown on the dashboard,
    /// not used for routing).
    pub prefix_cache_hit_ratio: Option<f64>,
}

/// Reads a Prometheus text body; `None` when it has neither queue gauge.
///
/// Only the sample lines of the gauges above are read; every other line (comments, other
/// families, histograms) is skipped without being understood. Of the registry's
/// exposition parsers, prometheus-parse rejects the colons of vLLM's and SGLang's names,
/// openmetrics-parser is LGPL, and nom-openmetrics fails a whole body on one family that
/// has descriptors and no samples (as Python's client writes for unlabelled children).
pub fn parse(body: &str) -> Option<Scraped> {
    parse_lines(body.lines().map(Cow::Borrowed))
}

/// [`parse`] over a page's lines.
fn parse_lines<'a>(lines: impl Iterator<Item = Cow<'a, str>>) -> Option<Scraped> {
    let (mut waiting, mut running, mut kv_usage) = (None::<f64>, None::<f64>, None::<f64>);
    let (mut hits, mut queries, mut hit_rate) = (None::<f64>, None::<f64>, None::<f64>);
    for line in lines {
        let Some((name, rest)) = wanted(&line) else {
            continue;
        };
        let Some(value) = value(rest) else {
            continue;
        };
        let add = |total: &mut Option<f64>| *total = Some(total.unwrap_or(0.0) + value);
        if WAITING.contains(&name) {
            add(&mut waiting);
        } else if RUNNING.contains(&name) {
            add(&mut running);
        } else if KV_USAGE.contains(&name) {
            kv_usage = Some(kv_usage.map_or(value, |v| v.max(value)));
        } else if PREFIX_HITS.contains(&name) {
            add(&mut hits);
        } else if PREFIX_QUERIES.contains(&name) {
            add(&mut queries);
        } else if PREFIX_HIT_RATE.contains(&name) {
            hit_rate = Some(value);
        }
    }
    if waiting.is_none() && running.is_none() {
        return None;
    }
    let prefix_cache_hit_ratio = match (hits, queries) {
        (Some(hits), Some(queries)) if queries > 0.0 => Some((hits / queries).clamp(0.0, 1.0)),
        _ => hit_rate,
    };
    Some(Scraped {
        waiting: waiting.unwrap_or(0.0),
        running: running.unwrap_or(0.0),
        kv_usage,
        prefix_cache_hit_ratio,
    })
}

/// [`parse`] of a page as received. Lines are cut at newlines found by `memchr` and only
/// those starting with a wanted family's prefix are read as text: a 128-worker fleet's
/// pages each second, checked whole as UTF-8 and split by `str::lines`, were the largest
/// cost of scraping. A stray invalid byte in a wanted line, say in a label value, is
/// replaced rather than failing the scrape.
fn parse_bytes(body: &[u8]) -> Option<Scraped> {
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', body).chain(std::iter::once(body.len()));
    let lines = ends.filter_map(|end| {
        let line = &body[start..end];
        start = end + 1;
        let first = line.iter().position(|b| !b.is_ascii_whitespace())?;
        let line = &line[first..];
        (line.starts_with(b"vllm:") || line.starts_with(b"sglang:"))
            .then(|| String::from_utf8_lossy(line))
    });
    parse_lines(lines)
}

/// A sample line of one of the families above: its name and what follows the name.
/// Other lines (comments, other families, every histogram bucket) are turned away by
/// their name alone: a scrape of 128 workers' pages each second must not parse them.
fn wanted(line: &str) -> Option<(&str, &str)> {
    let line = line.trim_start();
    if !(line.starts_with("vllm:") || line.starts_with("sglang:")) {
        return None;
    }
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    [
        WAITING,
        RUNNING,
        KV_USAGE,
        PREFIX_HITS,
        PREFIX_QUERIES,
        PREFIX_HIT_RATE,
    ]
    .iter()
    .any(|family| family.contains(&name))
    .then_some((name, rest))
}

/// The value of a sample line, given what follows its name (`{labels} value
/// [timestamp]`); `None` when unreadable.
fn value(rest: &str) -> Option<f64> {
    let mut rest = rest.trim_end();
    if rest.starts_with('{') {
        // Skip the labels; a quoted value may hold `}` and escaped quotes.
        let mut quoted = false;
        let mut escaped = false;
        let close = rest.char_indices().find(|&(_, c)| {
            let end = !quoted && c == '}';
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = quoted;
            } else if c == '"' {
                quoted = !quoted;
            }
            end
        })?;
        rest = &rest[close.0 + 1..];
    }
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some(value)
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

/// Scrape failures per worker.
#[derive(Debug, Default)]
pub struct LoadMetrics {
    failures: Family<WorkerLabels, Counter>,
}

impl LoadMetrics {
    /// Registers the family in `registry`.
    pub fn register(registry: &mut MetricsRegistry) -> Self {
        let metrics = Self::default();
        registry.register(
            "load_scrape_failures",
            "Scrapes of a worker's /metrics for its load that failed (no answer, an error \
             status, no queue gauges); routing uses this gateway's in-flight count meanwhile",
            metrics.failures.clone(),
        );
        metrics
    }

    fn failed(&self, worker: &str) {
        self.failures
            .get_or_create(&WorkerLabels {
                worker: worker.to_string(),
            })
            .inc();
    }
}

/// Scrapes every live worker each `interval` until aborted; nothing when `interval` is 0.
pub fn spawn(
    registry: Arc<Registry>,
    client: reqwest::Client,
    interval: Duration,
    metrics: Arc<LoadMetrics>,
) -> Option<JoinHandle<()>> {
    if interval.is_zero() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let roster = registry.snapshot();
            let scrapes = roster
                .members()
                .iter()
                .filter(|m| !m.worker.is_evicted())
                .map(|m| scrape(&client, &m.worker, interval, &metrics));
            futures::future::join_all(scrapes).await;
        }
    }))
}

/// One scrape of `worker`; a report stands for three intervals, so one lost scrape
/// does not drop the worker back to in-flight counts.
async fn scrape(
    client: &reqwest::Client,
    worker: &Worker,
    interval: Duration,
    metrics: &LoadMetrics,
) {
    let body = async {
        let response = client
            .get(worker.metrics_url().clone())
            .timeout(interval)
            .send()
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        // Bytes, not `text()`: a worker's page is ~25 KB, and `text()` decodes it by its
        // charset through a lossy pass, the largest cost of scraping a large fleet.
        response.bytes().await.ok()
    };
    match body.await.as_deref().and_then(parse_bytes) {
        Some(load) => worker.report_load(
            load.waiting,
            load.running,
            load.kv_usage,
            load.prefix_cache_hit_ratio,
            interval * 3,
        ),
        None => {
            metrics.failed(&worker.base);
            worker.clear_reported_load();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_with_an_invalid_byte_is_still_read() {
        let mut page = b"vllm:num_requests_running{model_name=\"m".to_vec();
        page.push(0xff);
        page.extend_from_slice(b"\"} 2\nvllm:num_requests_waiting 1\n");
        let load = parse_bytes(&page).expect("read despite the byte");
        assert_eq!((load.running, load.waiting), (2.0, 1.0));
        // Indented, CRLF-ended, the last line unended: read as the text parser reads it.
        let page = "# TYPE vllm:num_requests_running gauge\r\n  vllm:num_requests_running 3\r\n\
            vllm:request_success_total 9\nvllm:num_requests_waiting{a=\"}\"} 4";
        assert_eq!(parse_bytes(page.as_bytes()), parse(page));
        assert_eq!(
            parse(page).map(|l| (l.running, l.waiting)),
            Some((3.0, 4.0))
        );
    }

    #[test]
    fn vllm_and_sglang_gauges_are_read_and_others_are_not_load() {
        let vllm =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            # TYPE vllm:kv_cache_usage_perc gauge\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n";
        assert_eq!(
            parse(vllm),
            Some(Scraped {
                waiting: 2.0,
                running: 4.0,
                kv_usage: Some(0.5),
                prefix_cache_hit_ratio: None,
            })
        );
        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 7\nsglang:num_running_reqs{model_name=\"m\"} 5\nsglang:token_usage{model_name=\"m\"} 0.9\n";
        assert_eq!(
            parse(sglang),
            Some(Scraped {
                waiting: 7.0,
                running: 5.0,
                kv_usage: Some(0.9),
                prefix_cache_hit_ratio: None,
            })
        );
        // Labels holding braces, quotes and spaces; a timestamp; our own engine's
        // OpenMetrics ending.
        let odd =
            "vllm:num_requests_waiting{model_name=\"a } \\\"b\\\" c\"} 4 1712345678000\n# EOF\n";
        assert_eq!(
            parse(odd),
            Some(Scraped {
                waiting: 4.0,
                running: 0.0,
                kv_usage: None,
                prefix_cache_hit_ratio: None,
            })
        );
        let cached = "vllm:num_requests_running 1\nvllm:prefix_cache_queries_total{engine=\"0\"} 200\nvllm:prefix_cache_hits_total{engine=\"0\"} 50\n";
        assert_eq!(parse(cached).unwrap().prefix_cache_hit_ratio, Some(0.25));
        let sglang_rate = "sglang:num_running_reqs 1\nsglang:cache_hit_rate 0.5\n";
        assert_eq!(
            parse(sglang_rate).unwrap().prefix_cache_hit_ratio,
            Some(0.5)
        );
        assert_eq!(parse("process_cpu_seconds_total 3\n"), None);
        assert_eq!(parse("vllm:num_requests_waiting NaN\n"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("<html>not metrics</html>"), None);
    }
}
