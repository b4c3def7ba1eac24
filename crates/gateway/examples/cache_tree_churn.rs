//! Memory of the cache-aware policy under prefix churn: routes N distinct random prompts
//! (~200 characters each) through `cache_aware` with a `max_tree_size` cap and prints the
//! trees' size and the process RSS every 10k prompts. The size must stay under
//! workers × cap and the RSS must level off once the trees are full.
//!
//! ```sh
//! cargo run --release -p pdserve-gateway --example cache_tree_churn -- [N] [MAX_TREE_SIZE] [WORKERS]
//! ```
//! Defaults: 100000 prompts, 4 MiB per worker tree, 2 workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;
use pdserve_gateway::endpoint::Endpoint;
use pdserve_gateway::fleet::registry::{Worker, WorkerSpec};
use pdserve_gateway::ingress::request::ClientRequest;
use pdserve_gateway::policy::{self, PolicyConfig, RouteRequest};
use pdserve_protocol::WorkerRole;
use prometheus_client::metrics::gauge::Gauge;
use rand::distr::Alphanumeric;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The process's resident set size in KiB (Linux), or 0 where /proc is missing.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|a| a.parse().expect("arguments are numbers"))
        .unwrap_or(default)
}

fn main() {
    let n = arg(1, 100_000);
    let cap = arg(2, 4 << 20);
    let worker_count = arg(3, 2);
    let config = PolicyConfig {
        max_tree_size: cap,
        ..PolicyConfig::default()
    };
    let policy = policy::build("cache_aware", &config).expect("cache_aware exists");
    let workers: Vec<Arc<Worker>> = (0..worker_count)
        .map(|i| {
            let url = reqwest::Url::parse(&format!("http://127.0.0.1:{}", 8000 + i)).unwrap();
            Arc::new(Worker::new(
                WorkerSpec::new(WorkerRole::PrefillDecode, url),
                Gauge::default(),
            ))
        })
        .collect();
    let headers = HeaderMap::new();
    let mut rng = StdRng::seed_from_u64(42);
    let mut routing = Duration::ZERO;
    let mut prompt_bytes = 0usize;
    println!(
        "{n} prompts, {worker_count} workers, max_tree_size {cap} B per worker tree (bound {} B)",
        cap * worker_count
    );
    println!("rss at start: {} KiB", rss_kib());
    println!(
        "{:>8} {:>14} {:>14} {:>10} {:>12}",
        "prompts", "sent_bytes", "tree_bytes", "rss_kib", "select_ns"
    );
    let mut window_start = 0;
    for i in 1..=n {
        let len = rng.random_range(150..=250);
        let text: String = (&mut rng)
            .sample_iter(Alphanumeric)
            .take(len)
            .map(char::from)
            .collect();
        prompt_bytes += text.len();
        let body = serde_json::json!({"messages": [{"role": "user", "content": text}]});
        let (request, _) =
            ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
        let route = RouteRequest {
            endpoint: Endpoint::Chat,
            request: Some(&request),
            headers: &headers,
            conversation_id: None,
            tokens: None,
            notes: None,
            prefer: None,
            trace: None,
            seen: None,
            slo: Default::default(),
            local_prefill: false,
        };
        let started = Instant::now();
        let chosen = policy.select(WorkerRole::PrefillDecode, &workers, &route);
        routing += started.elapsed();
        assert!(chosen.is_some());
        let size = policy.tree_size();
        assert!(size <= cap * worker_count, "tree over its cap: {size}");
        if i % 10_000 == 0 || i == n {
            println!(
                "{i:>8} {prompt_bytes:>14} {size:>14} {:>10} {:>12}",
                rss_kib(),
                routing.as_nanos() / (i - window_start) as u128
            );
            routing = Duration::ZERO;
            window_start = i;
        }
    }
    let stats = policy.stats();
    println!(
        "hits {} misses {} imbalanced {}",
        stats.cache_hits, stats.cache_misses, stats.imbalanced
    );
}
