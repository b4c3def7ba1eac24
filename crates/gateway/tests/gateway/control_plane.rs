//! The live registry end to end: admin API, health probing with eviction and
//! re-admission, passive health, truthful readiness, roster changes under load, drain on
//! shutdown and pre-warm.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, pd_config, sse_data, Gateway};

const KEY: &str = "s3cret-admin-key";

/// A gateway with dynamic registration and fast probes over the given static pools.
fn dynamic(prefill: &[&Double], decode: &[&Double]) -> GatewayConfig {
    let mut config = pd_config(prefill, decode);
    config.admin_api_key = Some(KEY.into());
    config.probe.interval = Duration::from_millis(100);
    config.probe.timeout = Duration::from_millis(200);
    config
}

fn chat(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 3})
}

async fn admin(
    gw: &Gateway,
    method: reqwest::Method,
    query: &str,
    body: Option<Value>,
    key: Option<(&str, String)>,
) -> (u16, Value) {
    let mut req = client().request(method, gw.at(&format!("/instances{query}")));
    if let Some(body) = body {
        req = req.json(&body);
    }
    if let Some((header, value)) = key {
        req = req.header(header, value);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

fn x_api_key() -> Option<(&'static str, String)> {
    Some(("x-api-key", KEY.to_string()))
}

async fn register(gw: &Gateway, role: &str, url: &str) -> (u16, Value) {
    admin(
        gw,
        reqwest::Method::POST,
        "",
        Some(json!({"role": role, "url": url})),
        x_api_key(),
    )
    .await
}

async fn unregister(gw: &Gateway, url: &str) -> (u16, Value) {
    admin(
        gw,
        reqwest::Method::DELETE,
        &format!("?url={url}"),
        None,
        x_api_key(),
    )
    .await
}

async fn status_of(gw: &Gateway, path: &str) -> u16 {
    client()
        .get(gw.at(path))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The `health` of the worker at `url` in `/instances`, if it is registered.
async fn worker_health(gw: &Gateway, url: &str) -> Option<String> {
    let instances = gw.instances().await;
    instances["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .map(|w| w["health"].as_str().unwrap().to_string())
}

/// The circuit state of the worker at `url` in `/instances`.
async fn circuit(gw: &Gateway, url: &str) -> String {
    let instances = gw.instances().await;
    instances["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .map(|w| w["circuit"].as_str().unwrap().to_string())
        .unwrap_or_default()
}

/// Polls until `check` holds; returns how long it took.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_checks_the_key_and_validates_registrations() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(dynamic(&[], &[])).await;
        let post = |body: Value, key| admin(&gw, reqwest::Method::POST, "", Some(body), key);
        let body = json!({"role": "prefill", "url": p.url});

        // Auth: no key, a wrong key, a key of another length → 403, OpenAI-shaped.
        for key in [
            None,
            Some(("x-api-key", "wrong".to_string())),
            Some(("x-api-key", format!("{KEY}x"))),
            Some(("authorization", format!("Bearer {KEY}x"))),
            Some(("authorization", KEY.to_string())),
        ] {
            let (status, err) = post(body.clone(), key).await;
            assert_eq!(status, 403, "{err}");
            assert_eq!(err["error"]["type"], "permission_error", "{err}");
        }
        let (status, err) =
            admin(&gw, reqwest::Method::DELETE, "?url=http://h:1", None, None).await;
        assert_eq!(status, 403, "{err}");
        assert!(gw.instances().await["prefill"]["live"]
            .as_array()
            .unwrap()
            .is_empty());

        // Validation → 400 naming the field.
        for (bad, param) in [
            (json!({"role": "prefill", "url": "not a url"}), "url"),
            (
                json!({"role": "prefill", "url": "ftp://127.0.0.1:1"}),
                "url",
            ),
            (json!({"role": "chef", "url": p.url}), "role"),
            (
                json!({"role": "prefill", "url": p.url, "dp_size": 0}),
                "dp_size",
            ),
            (
                json!({"role": "prefill", "url": p.url, "dp_size": -2}),
                "dp_size",
            ),
        ] {
            let (status, err) = post(bad.clone(), x_api_key()).await;
            assert_eq!(status, 400, "{bad} → {err}");
            assert_eq!(err["error"]["param"], param, "{err}");
        }
        let (status, _) = admin(&gw, reqwest::Method::DELETE, "", None, x_api_key()).await;
        assert_eq!(status, 400, "DELETE without ?url=");

        // Registration, with either header; the same record again is a no-op.
        assert_eq!(
            post(body.clone(), x_api_key()).await,
            (200, json!({"registered": true}))
        );
        assert_eq!(
            post(
                body.clone(),
                Some(("authorization", format!("Bearer {KEY}")))
            )
            .await,
            (200, json!({"registered": false}))
        );
        assert_eq!(
            register(&gw, "decode", &format!("{}/", d.url)).await,
            (200, json!({"registered": true}))
        );
        // A role change, or mixing prefill_decode with split workers → 409.
        let (status, err) = register(&gw, "decode", &p.url).await;
        assert_eq!(status, 409, "{err}");
        let (status, err) = register(&gw, "prefill_decode", "http://127.0.0.1:9").await;
        assert_eq!(status, 409, "{err}");
        let (status, err) = register(&gw, "both", "http://127.0.0.1:9").await;
        assert_eq!(status, 409, "the alias is the same role: {err}");

        let instances = gw.instances().await;
        assert_eq!(instances["prefill"]["live"], json!([p.url]));
        assert_eq!(instances["decode"]["live"], json!([d.url]));
        assert_eq!(instances["mode"], "disaggregated");
        assert_eq!(instances["dynamic_registration"], true);
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&chat(false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);

        assert_eq!(
            unregister(&gw, &d.url).await,
            (200, json!({"removed": true}))
        );
        assert_eq!(
            unregister(&gw, &d.url).await,
            (200, json!({"removed": false}))
        );
        assert_eq!(gw.instances().await["mode"], "unavailable");

        // Without --dynamic-registration the admin routes are closed; the roster is readable.
        let fixed = Gateway::start(pd_config(&[&p], &[&d])).await;
        let (status, _) = admin(&fixed, reqwest::Method::POST, "", Some(body), x_api_key()).await;
        assert_eq!(status, 403);
        assert_eq!(fixed.instances().await["dynamic_registration"], false);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_says_what_is_missing() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(dynamic(&[], &[])).await;
        assert_eq!(status_of(&gw, "/liveness").await, 200);
        for path in ["/health", "/readiness"] {
            let resp = client().get(gw.at(path)).send().await.unwrap();
            assert_eq!(resp.status(), 503);
            let body: Value = resp.json().await.unwrap();
            assert_eq!(body["status"], "unavailable");
            assert!(!body["missing"].as_array().unwrap().is_empty(), "{body}");
        }
        register(&gw, "prefill", &p.url).await;
        let body = gw.health().await;
        assert_eq!(body["missing"], json!(["no decode worker is registered"]));
        register(&gw, "decode", &d.url).await;
        assert_eq!(status_of(&gw, "/health").await, 200);
        assert_eq!(status_of(&gw, "/readiness").await, 200);
        // A worker that says it is unhealthy is evicted; /health follows.
        d.set_healthy(false);
        wait_until(
            "eviction of the unhealthy decode worker",
            Duration::from_secs(5),
            || async { status_of(&gw, "/health").await == 503 },
        )
        .await;
        assert_eq!(
            gw.health().await["missing"],
            json!(["no healthy decode worker is available: 1 evicted after failed health probes"])
        );
        assert_eq!(status_of(&gw, "/liveness").await, 200);
        d.set_healthy(true);
        wait_until("re-admission", Duration::from_secs(5), || async {
            status_of(&gw, "/health").await == 200
        })
        .await;
    })
    .await;
}

/// Sends requests one after another until told to stop; counts failures.
fn light_load(
    gw_url: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let mut sent = 0;
        let mut failures = Vec::new();
        let mut i = 0;
        while !stop.load(Ordering::SeqCst) {
            i += 1;
            let stream = i % 2 == 0;
            let resp = client()
                .post(format!("{gw_url}/v1/chat/completions"))
                .json(&chat(stream))
                .send()
                .await;
            sent += 1;
            match resp {
                Ok(r) if r.status() == 200 => {
                    let text = r.text().await.unwrap_or_default();
                    if !text.contains("tok")
                        || (stream && !text.ends_with("data: [DONE]\n\n"))
                        || text.contains("\"error\"")
                    {
                        failures.push(format!("bad body: {text}"));
                    }
                }
                Ok(r) => failures.push(format!(
                    "{}: {}",
                    r.status(),
                    r.text().await.unwrap_or_default()
                )),
                Err(e) => failures.push(e.to_string()),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (sent, failures)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_workers_are_evicted_without_failed_requests_and_readmitted_on_return() {
    bounded(async {
        let p1 = Double::start(Role::Prefill, "P1").await;
        let mut p2 = Double::start(Role::Prefill, "P2").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let mut d2 = Double::start(Role::Decode, "D2").await;
        let mut config = dynamic(&[&p1, &p2], &[&d1, &d2]);
        config.admin_api_key = None;
        // One failed request opens a breaker; a trial after 200 ms may close it.
        config.health.breaker.failure_threshold = 1;
        config.health.breaker.cooldown = Duration::from_millis(200);
        let interval = config.probe.interval;
        let threshold = config.health.fail_threshold;
        let gw = Gateway::start(config).await;

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load = light_load(gw.url.clone(), stop.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let served_before = d2.requests().len();
        assert!(served_before > 0, "both decode workers serve before the kill");

        // Kill one prefill and one decode worker under load.
        p2.kill();
        d2.kill();
        let evict_p = wait_until("eviction of P2", Duration::from_secs(5), || async {
            worker_health(&gw, &p2.url).await.as_deref() == Some("evicted")
        });
        let evict_d = wait_until("eviction of D2", Duration::from_secs(5), || async {
            worker_health(&gw, &d2.url).await.as_deref() == Some("evicted")
        });
        let (evict_p, evict_d) = tokio::join!(evict_p, evict_d);
        assert_eq!(circuit(&gw, &d2.url).await, "open", "the failed request opened it");
        let bound = interval * threshold + Duration::from_millis(500);
        assert!(evict_p.max(evict_d) <= bound, "evicted after {evict_p:?}/{evict_d:?} > {bound:?}");
        eprintln!("kill test: evicted P2 after {evict_p:?}, D2 after {evict_d:?} (threshold x interval = {:?})", interval * threshold);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(status_of(&gw, "/health").await, 200, "P1 and D1 remain");

        // Bring them back on the same ports: re-admitted by the next healthy probe.
        p2.restart();
        d2.restart();
        let readmit = wait_until("re-admission of D2", Duration::from_secs(5), || async {
            worker_health(&gw, &d2.url).await.as_deref() == Some("live")
                && worker_health(&gw, &p2.url).await.as_deref() == Some("live")
        })
        .await;
        eprintln!("kill test: re-admitted P2 and D2 {readmit:?} after restart");
        let before = d2.requests().len();
        wait_until("traffic to the restarted D2", Duration::from_secs(5), || async {
            d2.requests().len() > before
        })
        .await;
        // The breaker D2's failed request opened closed again after a successful trial.
        wait_until("D2's circuit to close", Duration::from_secs(5), || async {
            circuit(&gw, &d2.url).await == "closed"
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        let (sent, failures) = load.await.unwrap();
        assert!(failures.is_empty(), "{} of {sent} client requests failed: {failures:?}", failures.len());
        assert!(sent > 20, "the load ran ({sent} requests)");
        eprintln!("kill test: {sent} client requests, 0 failed");

        // The last decode worker goes: /health turns 503, and back to 200 when it returns.
        drop(d1);
        d2.kill();
        wait_until("/health 503 with no decode worker", Duration::from_secs(5), || async {
            status_of(&gw, "/health").await == 503
        })
        .await;
        let resp = client().post(gw.at("/v1/chat/completions")).json(&chat(false)).send().await.unwrap();
        assert_eq!(resp.status(), 503);
        d2.restart();
        wait_until("/health 200 after D2 returns", Duration::from_secs(5), || async {
            status_of(&gw, "/health").await == 200
        })
        .await;
        let resp = client().post(gw.at("/v1/chat/completions")).json(&chat(false)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_evicts_at_once_without_waiting_for_a_probe() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let mut d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let mut config = pd_config(&[&p], &[&d1, &d2]);
        config.probe.interval = Duration::ZERO; // no active probing at all
        let gw = Gateway::start(config).await;
        d1.kill();
        for stream in [false, true, false, true] {
            let resp = client()
                .post(gw.at("/v1/chat/completions"))
                .json(&chat(stream))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert!(resp.text().await.unwrap().contains("tok2"));
        }
        assert_eq!(
            worker_health(&gw, &d1.url).await.as_deref(),
            Some("evicted")
        );
        // One request found D1 dead (and was retried on D2); the others went to D2 directly.
        let retries = client()
            .get(gw.at("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            retries.contains("pdserve_gateway_decode_retries_total 1"),
            "{retries}"
        );
        assert!(
            retries.contains(r#"pdserve_gateway_worker_evictions_total{role="decode"} 1"#),
            "{retries}"
        );
        assert_eq!(d2.requests().len(), 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_changes_under_load_keep_every_request_and_an_even_spread() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let d3 = Double::start(Role::Decode, "D3").await;
        let gw = Gateway::start(dynamic(&[&p], &[&d1, &d2])).await;

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let loads: Vec<_> = (0..4)
            .map(|_| light_load(gw.url.clone(), stop.clone()))
            .collect();
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(register(&gw, "decode", &d3.url).await.0, 200);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            unregister(&gw, &d1.url).await,
            (200, json!({"removed": true}))
        );
        // Requests already on D1 finish; none start there after the removal.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let d1_final = d1.requests().len();
        tokio::time::sleep(Duration::from_millis(150)).await;
        stop.store(true, Ordering::SeqCst);
        let mut sent = 0;
        for load in loads {
            let (n, failures) = load.await.unwrap();
            assert!(failures.is_empty(), "{failures:?}");
            sent += n;
        }
        assert_eq!(
            d1.requests().len(),
            d1_final,
            "a removed worker gets no new requests"
        );
        assert!(
            d3.requests().len() > 5,
            "the registered worker took traffic"
        );
        assert_eq!(
            d1.requests().len() + d2.requests().len() + d3.requests().len(),
            sent
        );

        // In a steady roster, requests spread evenly over the live decode workers.
        let (b2, b3) = (d2.requests().len(), d3.requests().len());
        let done = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (url, done) = (gw.url.clone(), done.clone());
                tokio::spawn(async move {
                    for _ in 0..10 {
                        let r = client()
                            .post(format!("{url}/v1/chat/completions"))
                            .json(&chat(false))
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(r.status(), 200);
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let (n2, n3) = (d2.requests().len() - b2, d3.requests().len() - b3);
        assert_eq!(n2 + n3, 40);
        assert!(n2.abs_diff(n3) <= 2, "spread {n2} vs {n3}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removed_mid_stream_finishes_the_stream() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::Gated);
        let gw = Gateway::start(dynamic(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            unregister(&gw, &d.url).await,
            (200, json!({"removed": true}))
        );
        assert_eq!(status_of(&gw, "/health").await, 503);
        d.release();
        let data = sse_data(&resp.text().await.unwrap());
        assert_eq!(data.last().unwrap(), "[DONE]");
        assert!(data.iter().all(|e| !e.contains("\"error\"")), "{data:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_open_streams_finish_then_stops_within_the_drain_limit() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::Gated);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(pdserve_gateway::serve(
            listener,
            pd_config(&[&p], &[&d]),
            async {
                let _ = rx.await;
            },
        ));
        let resp = client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        tx.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!server.is_finished(), "an open stream keeps the gateway up");
        d.release();
        let data = sse_data(&resp.text().await.unwrap());
        assert_eq!(data.last().unwrap(), "[DONE]");
        server.await.unwrap().unwrap();

        // A stream that never ends is cut at --shutdown-timeout.
        d.set(Behavior::Hold);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let mut config = pd_config(&[&p], &[&d]);
        config.shutdown_timeout = Duration::from_millis(300);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(pdserve_gateway::serve(listener, config, async {
            let _ = rx.await;
        }));
        let resp = client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let started = Instant::now();
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(resp);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_sends_one_tiny_request_through_each_new_pair() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let mut config = dynamic(&[&p], &[&d1]);
        config.prewarm = true;
        let gw = Gateway::start(config).await;
        d1.wait_for_requests(1).await;
        let warm = d1.only_request();
        assert_eq!(warm.path, "/v1/completions");
        assert_eq!(warm.body["prompt"], " x");
        assert_eq!(warm.body["max_tokens"], 1);
        assert_eq!(warm.body["model"], "m");
        // D got P's KV handle: the warm-up crossed the real handoff.
        let p_warm = p.only_request();
        assert_eq!(p_warm.body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(
            warm.body["kv_transfer_params"]["remote_engine_id"],
            "engine-P"
        );

        // A newly registered decode worker makes a new pair: it is warmed too.
        register(&gw, "decode", &d2.url).await;
        d2.wait_for_requests(1).await;
        assert_eq!(d2.only_request().body["prompt"], " x");
        p.wait_for_requests(2).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            d1.requests().len(),
            1,
            "an already warm pair is not warmed again"
        );
    })
    .await;
}
