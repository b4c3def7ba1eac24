//! KV events end to end: prefill and decode workers publish their prefix caches
//! (`--kv-events-config`), the gateway and a test subscriber follow them. After a P/D
//! request both indexes hold the prompt's full blocks — the prefill worker's computed,
//! the decode worker's imported over KV transfer — and blocks the pool reclaims leave
//! the index again.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use pdserve_engine::Worker;
use pdserve_gateway::fleet::kv_events::subscriber::{follow, EventEndpoints};
use pdserve_gateway::fleet::kv_events::{KvEventMetrics, WorkerEvents};
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};
use tokio::net::TcpListener;

#[path = "support/worker.rs"]
mod worker;

use worker::start_worker;

const BLOCK: usize = 16;

fn endpoints(worker: &Worker) -> EventEndpoints {
    let (publisher, replay) = worker.kv_events_endpoints().expect("events are on");
    EventEndpoints {
        publisher: publisher.to_string(),
        replay: replay.map(str::to_string),
    }
}

/// A prompt of `len` token ids, distinct per `salt`.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (i * 7 + salt * 131) % 4000)
        .collect()
}

async fn complete(http: &reqwest::Client, base: &str, tokens: &[u32]) -> Value {
    let response = http
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": tokens, "max_tokens": 2, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn metric(http: &reqwest::Client, gateway: &str, name: &str) -> f64 {
    let text = http
        .get(format!("{gateway}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..300 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexes_follow_computed_imported_and_reclaimed_blocks() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let events = |role: &str| {
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:0",
                "replay_endpoint": "tcp://127.0.0.1:0",
                "topic": format!("kv@{role}"),
            })
            .to_string()
        };
        let (p_events, d_events) = (events("prefill"), events("decode"));
        let (prefill, p_url) =
            start_worker("prefill", &model, &["--num-kv-blocks", "40", "--kv-events-config", &p_events]).await;
        let (decode, d_url) =
            start_worker("decode", &model, &["--num-kv-blocks", "40", "--kv-events-config", &d_events]).await;

        // The test's own subscribers, to compare prompts with the indexes exactly.
        let metrics = Arc::new(KvEventMetrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let cap = NonZeroUsize::new(10_000).unwrap();
        let (p_events, d_events) = (Arc::new(WorkerEvents::new(cap)), Arc::new(WorkerEvents::new(cap)));
        let followers = [
            tokio::spawn(follow(p_url.clone(), endpoints(&prefill), p_events.clone(), metrics.clone(), Duration::from_secs(60))),
            tokio::spawn(follow(d_url.clone(), endpoints(&decode), d_events.clone(), metrics.clone(), Duration::from_secs(60))),
        ];

        let mut config = GatewayConfig::new(
            vec![p_url.parse().unwrap()],
            vec![d_url.parse().unwrap()],
            Vec::new(),
        );
        for (url, worker) in [(&p_url, &prefill), (&d_url, &decode)] {
            let e = endpoints(worker);
            config.kv_events.publishers.insert(url.clone(), e.publisher);
            config.kv_events.replays.insert(url.clone(), e.replay.unwrap());
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(pdserve_gateway::serve(listener, config, async {
            let _ = stopped.await;
        }));
        let http = reqwest::Client::builder().no_proxy().build().unwrap();

        // Warm up until every subscriber has heard its worker (a PUB socket drops what
        // it sends before a subscriber is connected; the next batch replays it).
        let mut salt = 1000;
        loop {
            complete(&http, &gateway, &prompt(40, salt)).await;
            salt += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let gateway_heard = metric(&http, &gateway, "pdserve_gateway_kv_events_total").await;
            if p_events.last_heard().is_some() && d_events.last_heard().is_some() && gateway_heard >= 2.0 {
                break;
            }
        }

        // One P/D request: the prompt's 6 full blocks are computed by prefill and
        // imported by decode, and both say so.
        let first = prompt(100, 1);
        let answer = complete(&http, &gateway, &first).await;
        assert!(answer["choices"][0]["text"].is_string());
        let full = first.len() / BLOCK * BLOCK;
        eventually("prefill's index holds the prompt", || p_events.cached_tokens(&first) == Some(full)).await;
        eventually("decode's index holds the imported prompt", || d_events.cached_tokens(&first) == Some(full)).await;
        let other = prompt(100, 2);
        assert_eq!(p_events.cached_tokens(&other), Some(0), "an unseen prompt matches nothing");
        // The gateway's own subscriptions index the same blocks.
        for url in [&p_url, &d_url] {
            let blocks = metric(&http, &gateway, &format!(r#"pdserve_gateway_kv_index_blocks{{worker="{url}"}}"#)).await;
            assert!(blocks >= (full / BLOCK) as f64, "{url}: {blocks} blocks indexed");
        }

        // Fill the 40-block pools with other prompts: the first prompt's blocks are
        // reclaimed, and the indexes drop them.
        for salt in 2..12 {
            complete(&http, &gateway, &prompt(100, salt)).await;
        }
        eventually("prefill's reclaimed blocks leave its index", || {
            p_events.cached_tokens(&first).unwrap_or(0) < full
        })
        .await;
        assert!(
            metric(&http, &gateway, "pdserve_gateway_kv_events_total{").await > 0.0
                && metric(&http, &gateway, &format!(r#"pdserve_gateway_kv_events_total{{worker="{p_url}",kind="block_removed"}}"#)).await > 0.0,
            "removals are counted"
        );
        // The gateway reads the workers' own load from their /metrics too.
        let instances: Value = http
            .get(format!("{gateway}/instances"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        for worker in instances["workers"].as_array().unwrap() {
            assert!(
                worker["reported_load"]["running"].is_number(),
                "the worker's vllm:* gauges were read: {worker}"
            );
        }
        // No gap went unexplained: a replay filled any.
        assert_eq!(metric(&http, &gateway, "pdserve_gateway_kv_index_rebuilds_total").await, 0.0);

        for f in followers {
            f.abort();
        }
        let _ = stop.send(());
        let _ = served.await;
        let _ = prefill.shutdown().await;
        let _ = decode.shutdown().await;
    })
    .await
    .expect("test exceeded its time limit");
}
