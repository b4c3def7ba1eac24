//! KV events end to end, in both layouts vLLM is deployed with:
//!
//! - subscription: prefill and decode workers bind their publishers (`ipc://`, which
//!   binds by vLLM's rule), the gateway and a test subscriber follow them. After a P/D
//!   request both indexes hold the prompt's full blocks — the prefill worker's computed,
//!   the decode worker's imported over KV transfer — and blocks the pool reclaims leave
//!   the index again.
//! - both layouts, with two aggregated workers under `precise_prefix`: the gateway
//!   subscribes (`--kv-events`), or binds a collector (`--kv-events-bind
//!   tcp://127.0.0.1:PORT`) that the workers' concrete endpoints connect to, with topics
//!   `kv@127.0.0.1:PORT@MODEL`; either way it counts the workers' events and sends
//!   prompts warmed on one worker to that worker, on what its events say.
//! - SGLang's handoff under `precise_prefix`: a prompt both workers refused is not
//!   counted as sent to them.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use pdserve_engine::Worker;
use pdserve_gateway::config::Protocol;
use pdserve_gateway::fleet::kv_events::subscriber::{follow, EventEndpoints};
use pdserve_gateway::fleet::kv_events::{KvEventMetrics, WorkerEvents};
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};
use tokio::net::TcpListener;

#[path = "support/worker.rs"]
mod worker;

use worker::{start_worker, start_worker_on};

/// A fresh folder for socket files, removed when dropped.
struct SocketDir(std::path::PathBuf);

impl SocketDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("pdserve-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// `ipc://` endpoint of `name` in the folder.
    fn ipc(&self, name: &str) -> String {
        format!("ipc://{}", self.0.join(name).display())
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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

/// A gateway serving on a free loopback port until [`ServedGateway::stop`].
struct ServedGateway {
    url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<Result<(), pdserve_gateway::GatewayError>>,
}

impl ServedGateway {
    async fn start(config: GatewayConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(pdserve_gateway::serve(listener, config, async {
            let _ = stopped.await;
        }));
        Self { url, stop, served }
    }

    /// Stops the gateway and waits for it to finish serving.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
    }
}

/// Sends `tokens` through `gateway` under another model's name (the workers answer 404),
/// then as they are; returns the second answer, a 200.
async fn refused_then_sent(
    http: &reqwest::Client,
    gateway: &str,
    tokens: &[u32],
) -> reqwest::Response {
    let send = |model: Option<&str>| {
        let mut body = json!({"prompt": tokens, "max_tokens": 2, "temperature": 0});
        if let Some(model) = model {
            body["model"] = json!(model);
        }
        http.post(format!("{gateway}/v1/completions"))
            .json(&body)
            .send()
    };
    assert_eq!(send(Some("no-such-model")).await.unwrap().status(), 404);
    let response = send(None).await.unwrap();
    assert_eq!(response.status(), 200);
    response
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
        let sockets = SocketDir::new("kvev-pd");
        let events = |role: &str| {
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": sockets.ipc(&format!("{role}.sock")),
                "replay_endpoint": sockets.ipc(&format!("{role}-replay.sock")),
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

/// How the gateway hears the workers' events.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Each worker binds (`ipc://`); the gateway subscribes with `--kv-events`.
    Subscription,
    /// The gateway binds `--kv-events-bind tcp://127.0.0.1:PORT`; each worker's concrete
    /// endpoint connects to it, with topic `kv@127.0.0.1:HTTP_PORT@MODEL`.
    Collector,
}

/// Two aggregated workers under `precise_prefix`: prompts sent straight to one of them
/// warm its cache, its events say so, and the gateway sends those prompts to it.
async fn warmed_prompts_go_to_the_warm_worker(layout: Layout) {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let sockets = SocketDir::new(&format!("kvev-{layout:?}"));
    let collector = {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("tcp://127.0.0.1:{port}")
    };
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for name in ["a", "b"] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let config = match layout {
            Layout::Subscription => json!({
                "enable_kv_cache_events": true,
                "endpoint": sockets.ipc(&format!("{name}.sock")),
            }),
            Layout::Collector => json!({
                "enable_kv_cache_events": true,
                "endpoint": collector,
                "topic": format!("kv@{address}@model"),
            }),
        }
        .to_string();
        let (worker, url) = start_worker_on(
            listener,
            "prefill_decode",
            &model,
            &["--kv-events-config", &config],
        )
        .await;
        workers.push(worker);
        urls.push(url);
    }
    let mut config = GatewayConfig::new(
        Vec::new(),
        Vec::new(),
        urls.iter().map(|u| u.parse().unwrap()).collect(),
    );
    config.policy = "precise_prefix".into();
    config.expose_routing = true;
    match layout {
        Layout::Subscription => {
            for (url, worker) in urls.iter().zip(&workers) {
                let (endpoint, _) = worker.kv_events_endpoints().unwrap();
                config
                    .kv_events
                    .publishers
                    .insert(url.clone(), endpoint.to_string());
            }
        }
        Layout::Collector => config.kv_events.bind = Some(collector.clone()),
    }
    let served = ServedGateway::start(config).await;
    let gateway = served.url.clone();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let events_of = |url: &str| format!(r#"pdserve_gateway_kv_events_total{{worker="{url}""#);
    let blocks_of = |url: &str| format!(r#"pdserve_gateway_kv_index_blocks{{worker="{url}"}}"#);

    // Until the gateway hears both workers (a PUB socket drops what it sends before the
    // subscription reaches it).
    let mut salt = 5000;
    loop {
        for url in &urls {
            complete(&http, url, &prompt(20, salt)).await;
            salt += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut heard = true;
        for url in &urls {
            heard &= metric(&http, &gateway, &events_of(url)).await > 0.0;
        }
        if heard {
            break;
        }
    }

    // Warm six prompts on worker b (the second: no tie-break favours it), straight to it; its index holds them all.
    let warm: Vec<Vec<u32>> = (0..6).map(|i| prompt(100, 300 + i)).collect();
    let before = metric(&http, &gateway, &blocks_of(&urls[1])).await;
    for tokens in &warm {
        complete(&http, &urls[1], tokens).await;
    }
    let full = (warm.len() * (100 / BLOCK)) as f64;
    for _ in 0..300 {
        if metric(&http, &gateway, &blocks_of(&urls[1])).await >= before + full {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        metric(&http, &gateway, &blocks_of(&urls[1])).await >= before + full,
        "{layout:?}: worker b's index holds the warmed prompts"
    );

    // Through the gateway, every warmed prompt goes to worker b, on what its events say.
    for tokens in &warm {
        let response = http
            .post(format!("{gateway}/v1/completions"))
            .json(&json!({"prompt": tokens, "max_tokens": 2, "temperature": 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let chosen = response.headers()["x-pdserve-worker"]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(
            chosen, urls[1],
            "{layout:?}: a warmed prompt went elsewhere"
        );
    }
    // A new prompt the worker refused (another model's name: 404) is not cached there:
    // sent the right way next, the worker it goes to holds none of it.
    let response = refused_then_sent(&http, &gateway, &prompt(100, 900)).await;
    let cache = response.headers()["x-pdserve-worker-cache"]
        .to_str()
        .unwrap();
    assert!(
        cache.contains("matched=0;"),
        "{layout:?}: a refused prompt counted as cached: {cache}"
    );

    if let Layout::Collector = layout {
        assert_eq!(
            metric(
                &http,
                &gateway,
                "pdserve_gateway_kv_events_unknown_topic_total"
            )
            .await,
            0.0,
            "every topic named a worker"
        );
    }

    served.stop().await;
    for worker in workers {
        let _ = worker.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribed_events_steer_precise_prefix() {
    tokio::time::timeout(
        Duration::from_secs(300),
        warmed_prompts_go_to_the_warm_worker(Layout::Subscription),
    )
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collected_events_steer_precise_prefix() {
    tokio::time::timeout(
        Duration::from_secs(300),
        warmed_prompts_go_to_the_warm_worker(Layout::Collector),
    )
    .await
    .expect("test exceeded its time limit");
}

/// In SGLang's handoff too, a prompt the workers refused (another model's name: 404) is
/// not counted as sent to them: sent the right way next, neither worker it goes to holds
/// any of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_refused_in_sglangs_handoff_is_not_counted_as_sent() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let sockets = SocketDir::new("kvev-sglang");
    let bootstrap_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let events = |name: &str| {
        json!({"enable_kv_cache_events": true, "endpoint": sockets.ipc(name)}).to_string()
    };
    let (prefill_worker, prefill) = start_worker(
        "prefill",
        &model,
        &[
            "--bootstrap-port",
            &bootstrap_port,
            "--kv-events-config",
            &events("p.sock"),
        ],
    )
    .await;
    let (decode_worker, decode) =
        start_worker("decode", &model, &["--kv-events-config", &events("d.sock")]).await;
    let mut config = GatewayConfig::new(
        vec![prefill.parse().unwrap()],
        vec![decode.parse().unwrap()],
        Vec::new(),
    );
    config.protocol = Protocol::Sglang;
    config.prefill_bootstrap_ports = vec![Some(bootstrap_port.parse().unwrap())];
    config.policy = "precise_prefix".into();
    config.expose_routing = true;
    for (url, worker) in [(&prefill, &prefill_worker), (&decode, &decode_worker)] {
        let (endpoint, _) = worker.kv_events_endpoints().unwrap();
        config
            .kv_events
            .publishers
            .insert(url.clone(), endpoint.to_string());
    }
    let served = ServedGateway::start(config).await;
    let gateway = served.url.clone();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let events_of = |url: &str| format!(r#"pdserve_gateway_kv_events_total{{worker="{url}""#);

    // Until the gateway hears both workers (so each has a trusted index).
    let mut heard = false;
    for salt in 7000..7100 {
        complete(&http, &gateway, &prompt(40, salt)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        heard = metric(&http, &gateway, &events_of(&prefill)).await > 0.0
            && metric(&http, &gateway, &events_of(&decode)).await > 0.0;
        if heard {
            break;
        }
    }
    assert!(heard, "the gateway never heard both workers' events");

    let response = refused_then_sent(&http, &gateway, &prompt(900, 100)).await;
    for header in ["x-pdserve-prefill-cache", "x-pdserve-decode-cache"] {
        let cache = response.headers()[header].to_str().unwrap();
        assert!(
            cache.contains("matched=0;"),
            "{header}: a refused prompt counted as sent: {cache}"
        );
    }

    served.stop().await;
    for worker in [prefill_worker, decode_worker] {
        worker.shutdown().await.unwrap();
    }
}
