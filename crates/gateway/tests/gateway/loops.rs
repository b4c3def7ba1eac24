//! A gateway is not a worker: registrations and static flags that name a gateway are
//! refused, requests that loop through gateways end at once with 508, and registrations
//! are bounded (dp_size, body size, roster size).

use std::time::{Duration, Instant};

use pdserve_gateway::fleet::registry::parse_worker_url;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Double, Role};
use crate::{bounded, client, metric, pd_config, Gateway};

const KEY: &str = "loop-admin-key";

/// A gateway with dynamic registration and no static workers.
fn dynamic() -> GatewayConfig {
    let mut config = GatewayConfig::new(Vec::new(), Vec::new(), Vec::new());
    config.admin_api_key = Some(KEY.into());
    config
}

async fn register_body(gw: &Gateway, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let response = client()
        .post(gw.at("/instances"))
        .header("x-api-key", KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn register(gw: &Gateway, role: &str, url: &str) -> (u16, Value) {
    register_body(gw, json!({"role": role, "url": url}).to_string()).await
}

async fn chat(gw: &Gateway, stream: bool) -> (u16, Value) {
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream});
    let response = client()
        .post(gw.at("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

#[tokio::test]
async fn a_gateway_cannot_register_itself_or_another_gateway_by_default() {
    bounded(async {
        let gw = Gateway::start(dynamic()).await;
        let other = Gateway::start(dynamic()).await;
        let health = gw.health().await;
        assert_eq!(health["server"], "pdserve-gateway", "{health}");
        assert!(health["instance_id"].is_string(), "{health}");

        let (status, err) = register(&gw, "prefill_decode", &gw.url).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "url", "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&gw.url) && message.contains("itself"),
            "{err}"
        );

        let (status, err) = register(&gw, "decode", &other.url).await;
        assert_eq!(status, 400, "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&other.url) && message.contains("--allow-gateway-workers"),
            "{err}"
        );
        assert_eq!(
            metric(&gw, "pdserve_gateway_workers_refused_total").await,
            2.0
        );
        assert!(gw.instances().await["workers"]
            .as_array()
            .unwrap()
            .is_empty());
        // Nothing live: the gateway does not count itself as a worker.
        let response = client().get(gw.at("/health")).send().await.unwrap();
        assert_eq!(response.status(), 503);

        // Even allowed to route to gateways, it never takes itself.
        let mut config = dynamic();
        config.allow_gateway_workers = true;
        let tier = Gateway::start(config).await;
        let (status, err) = register(&tier, "prefill_decode", &tier.url).await;
        assert_eq!(status, 400, "{err}");
        let (status, answer) = register(&tier, "prefill_decode", &other.url).await;
        assert_eq!((status, &answer), (200, &json!({"registered": true})));
    })
    .await;
}

#[tokio::test]
async fn a_static_worker_flag_naming_the_gateway_itself_is_refused_at_start() {
    bounded(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let config = GatewayConfig::new(
            Vec::new(),
            Vec::new(),
            vec![parse_worker_url("--worker", &url).unwrap()],
        );
        let started = Instant::now();
        let result = pdserve_gateway::serve(listener, config, std::future::pending()).await;
        let err = result.expect_err("a gateway that is its own worker must not run");
        let message = err.to_string();
        assert!(
            message.contains(&url) && message.contains("itself"),
            "{message}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    })
    .await;
}

#[tokio::test]
async fn gateways_that_route_to_each_other_end_every_request_with_508_at_once() {
    bounded(async {
        let allowed = || {
            let mut config = dynamic();
            config.allow_gateway_workers = true;
            config
        };
        let a = Gateway::start(allowed()).await;
        let b = Gateway::start(allowed()).await;
        assert_eq!(register(&a, "prefill_decode", &b.url).await.0, 200);
        assert_eq!(register(&b, "prefill_decode", &a.url).await.0, 200);
        for gw in [&a, &b] {
            for stream in [false, true] {
                let started = Instant::now();
                let (status, err) = chat(gw, stream).await;
                let took = started.elapsed();
                assert_eq!(status, 508, "stream={stream}: {err}");
                assert_eq!(err["error"]["code"], "loop_detected", "{err}");
                assert!(
                    took < Duration::from_secs(1),
                    "stream={stream}: 508 after {took:?}"
                );
            }
        }
        let refused = metric(&a, "pdserve_gateway_loops_refused_total").await
            + metric(&b, "pdserve_gateway_loops_refused_total").await;
        assert_eq!(refused, 4.0, "one refusal per request");
        // A loop is the request's fault, not the workers': nobody is evicted or tripped.
        for gw in [&a, &b] {
            let instances = gw.instances().await;
            let worker = &instances["workers"][0];
            assert_eq!(worker["health"], "live", "{instances}");
            assert_eq!(worker["circuit"], "closed", "{instances}");
        }
    })
    .await;
}

#[tokio::test]
async fn a_chain_of_gateways_serves_within_max_hops() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let inner = Gateway::start(pd_config(&[&p], &[&d])).await;
        let tier = |worker: &str, max_hops: u32| {
            let mut config = GatewayConfig::new(
                Vec::new(),
                Vec::new(),
                vec![parse_worker_url("--worker", worker).unwrap()],
            );
            config.allow_gateway_workers = true;
            config.max_hops = max_hops;
            config
        };
        let outer = Gateway::start(tier(&inner.url, 4)).await;
        for stream in [false, true] {
            let (status, answer) = chat(&outer, stream).await;
            assert_eq!(status, 200, "stream={stream}: {answer}");
        }
        // Both gateways named themselves on the legs the workers got, in order.
        let decode_leg = d
            .requests()
            .into_iter()
            .find(|r| r.path == "/v1/chat/completions")
            .expect("the decode double got the chat request");
        let hops = decode_leg.headers["x-pdserve-hops"]
            .to_str()
            .unwrap()
            .to_string();
        let mut ids = Vec::new();
        for gw in [&outer, &inner] {
            ids.push(
                gw.health().await["instance_id"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            );
        }
        assert_eq!(hops, ids.join(","));

        // Three gateways where --max-hops allows two: refused by the third.
        let middle = Gateway::start(tier(&inner.url, 4)).await;
        let top = Gateway::start(tier(&middle.url, 4)).await;
        assert_eq!(chat(&top, false).await.0, 200, "three hops are within 4");
        let mut config = pd_config(&[&p], &[&d]);
        config.max_hops = 2;
        let strict = Gateway::start(config).await;
        let middle = Gateway::start(tier(&strict.url, 4)).await;
        let top = Gateway::start(tier(&middle.url, 4)).await;
        let (status, err) = chat(&top, false).await;
        assert_eq!(status, 508, "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-hops"),
            "{err}"
        );
    })
    .await;
}

#[tokio::test]
async fn registrations_are_bounded() {
    bounded(async {
        let mut config = dynamic();
        config.health.max_workers = 2;
        let gw = Gateway::start(config).await;

        let (status, err) = register_body(
            &gw,
            json!({"role": "decode", "url": "http://127.0.0.1:9", "dp_size": 1_000_000_000u64})
                .to_string(),
        )
        .await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "dp_size", "{err}");

        let huge = format!(
            r#"{{"role": "decode", "url": "http://127.0.0.1:9", "pad": "{}"}}"#,
            "x".repeat(10 * 1024 * 1024)
        );
        let (status, err) = register_body(&gw, huge).await;
        assert_eq!(status, 413, "{err}");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");

        for port in [9, 10] {
            let (status, answer) =
                register(&gw, "decode", &format!("http://127.0.0.1:{port}")).await;
            assert_eq!(status, 200, "{answer}");
        }
        let (status, err) = register(&gw, "decode", "http://127.0.0.1:11").await;
        assert_eq!(status, 429, "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-workers"),
            "{err}"
        );
    })
    .await;
}
