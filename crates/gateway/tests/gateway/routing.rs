//! Routing beyond round-robin: retries on fresh workers, circuit breakers, data-parallel
//! ranks and routing headers.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, pd_config, sse_data, urls, Gateway};

fn chat(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 3})
}

async fn metrics(gw: &Gateway) -> String {
    client()
        .get(gw.at("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn post_chat(gw: &Gateway, stream: bool) -> reqwest::Response {
    client()
        .post(gw.at("/v1/chat/completions"))
        .json(&chat(stream))
        .send()
        .await
        .unwrap()
}

async fn circuit_of(gw: &Gateway, url: &str) -> String {
    let instances = gw.instances().await;
    instances["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .unwrap()["circuit"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_routed_around_and_its_breaker_opens_then_closes() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let bad = Double::start(Role::Decode, "BAD").await;
        let good = Double::start(Role::Decode, "GOOD").await;
        bad.set(Behavior::Status(
            500,
            r#"{"error":{"message":"engine dead"}}"#,
        ));
        let mut config = pd_config(&[&p], &[&bad, &good]);
        config.health.breaker.failure_threshold = 2;
        config.health.breaker.cooldown = Duration::from_millis(400);
        let gw = Gateway::start(config).await;

        // Every request succeeds (retried on GOOD) while BAD fails; after two failures
        // BAD's circuit opens and it stops receiving requests.
        for i in 0..10 {
            let resp = post_chat(&gw, i % 2 == 0).await;
            assert_eq!(resp.status(), 200);
            assert!(resp.text().await.unwrap().contains("tok2"));
        }
        assert_eq!(bad.requests().len(), 2, "open after two failures");
        assert_eq!(circuit_of(&gw, &bad.url).await, "open");
        let text = metrics(&gw).await;
        assert!(
            text.contains(&format!(
                "pdserve_gateway_worker_circuit_state{{role=\"decode\",worker=\"{}\"}} 1",
                bad.url
            )),
            "{text}"
        );
        assert!(
            text.contains(r#"pdserve_gateway_retries_total{leg="decode",reason="status_5xx"} 2"#),
            "{text}"
        );

        // After the cooldown one trial request decides: BAD answers again, so it closes.
        bad.set(Behavior::Normal);
        tokio::time::sleep(Duration::from_millis(450)).await;
        let start = Instant::now();
        while circuit_of(&gw, &bad.url).await != "closed" {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the circuit never closed"
            );
            let resp = post_chat(&gw, false).await;
            assert_eq!(resp.status(), 200);
        }
        assert_eq!(bad.requests().len(), 3, "exactly one trial request");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_whose_every_breaker_is_open_is_still_tried_and_a_recovered_worker_serves() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let only = Double::start(Role::Decode, "ONLY").await;
        only.set(Behavior::Status(
            500,
            r#"{"error":{"message":"engine restarting"}}"#,
        ));
        let mut config = pd_config(&[&p], &[&only]);
        config.health.breaker.failure_threshold = 2;
        // A cooldown far longer than the test: only panic routing can reach the worker.
        config.health.breaker.cooldown = Duration::from_secs(600);
        let gw = Gateway::start(config).await;
        for _ in 0..2 {
            let resp = post_chat(&gw, false).await;
            assert_eq!(resp.status(), 502);
        }
        assert_eq!(circuit_of(&gw, &only.url).await, "open");
        let instances = gw.instances().await;
        let state = &instances["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == only.url)
            .unwrap()["state"];
        assert_eq!(state, "breaker_open");

        // The worker is back: the next request reaches it (no 503 while the cooldown
        // runs), and its success closes the circuit.
        only.set(Behavior::Normal);
        for stream in [false, true] {
            let resp = post_chat(&gw, stream).await;
            assert_eq!(resp.status(), 200);
            assert!(resp.text().await.unwrap().contains("tok2"));
        }
        assert_eq!(circuit_of(&gw, &only.url).await, "closed");
        assert_eq!(only.requests().len(), 4);
        assert!(
            crate::metric(&gw, "pdserve_gateway_panic_routed_total{role=\"decode\"}").await >= 1.0
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_says_which_state_kept_the_workers_out_and_is_counted() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.probe.interval = Duration::from_millis(100);
        let gw = Gateway::start(config).await;

        // A draining worker is evicted at its next probe and never tried.
        d.set_draining(true);
        let start = Instant::now();
        loop {
            let instances = gw.instances().await;
            let w = instances["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["url"] == d.url)
                .unwrap()
                .clone();
            if w["state"] == "draining" {
                assert_eq!(w["health"], "evicted");
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "never seen draining: {w}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let before = d.requests().len();
        let resp = post_chat(&gw, false).await;
        assert_eq!(resp.status(), 503);
        let body: Value = resp.json().await.unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("no healthy decode worker") && message.contains("1 draining"),
            "{message}"
        );
        assert_eq!(
            d.requests().len(),
            before,
            "a draining worker gets no request"
        );
        assert_eq!(
            crate::metric(
                &gw,
                r#"pdserve_gateway_refused_total{role="decode",reason="draining"}"#
            )
            .await,
            1.0
        );

        // Back from draining: a passing probe re-admits it.
        d.set_draining(false);
        let start = Instant::now();
        loop {
            let resp = post_chat(&gw, false).await;
            if resp.status() == 200 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "never re-admitted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_with_no_worker_registered_is_refused_as_no_worker() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let gw = Gateway::start(pd_config(&[&p], &[])).await;
        let resp = client()
            .post(gw.at("/v1/completions"))
            .json(&json!({"prompt": "hi", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        let body: Value = resp.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("no decode worker is registered"),
            "{body}"
        );
        assert_eq!(
            crate::metric(
                &gw,
                r#"pdserve_gateway_refused_total{role="decode",reason="no_worker"}"#
            )
            .await,
            1.0
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_never_resend_after_the_first_byte_and_never_a_4xx() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        d1.set(Behavior::FailMidStream);
        d2.set(Behavior::FailMidStream);
        let gw = Gateway::start(pd_config(&[&p], &[&d1, &d2])).await;
        let resp = post_chat(&gw, true).await;
        assert_eq!(resp.status(), 200);
        let data = sse_data(&resp.text().await.unwrap());
        assert!(data.iter().any(|e| e.contains("\"error\"")), "{data:?}");
        assert_eq!(
            d1.requests().len() + d2.requests().len(),
            1,
            "no resend after bytes went out"
        );

        d1.set(Behavior::Status(400, r#"{"error":{"message":"bad"}}"#));
        d2.set(Behavior::Status(400, r#"{"error":{"message":"bad"}}"#));
        let resp = post_chat(&gw, false).await;
        assert_eq!(resp.status(), 400);
        assert_eq!(
            d1.requests().len() + d2.requests().len(),
            2,
            "a 4xx is final"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_failures_are_retried_on_a_fresh_prefill_worker() {
    bounded(async {
        let p1 = Double::start(Role::Prefill, "P1").await;
        let p2 = Double::start(Role::Prefill, "P2").await;
        let d = Double::start(Role::Decode, "D").await;
        p1.set(Behavior::Status(503, "overloaded"));
        let gw = Gateway::start(pd_config(&[&p1, &p2], &[&d])).await;
        for _ in 0..4 {
            let resp = post_chat(&gw, false).await;
            assert_eq!(resp.status(), 200);
        }
        assert_eq!(p2.requests().len(), 4);
        let text = metrics(&gw).await;
        assert!(
            text.contains(r#"pdserve_gateway_retries_total{leg="prefill",reason="status_5xx"}"#),
            "{text}"
        );
        // Each decode leg carried the handle of the prefill worker that succeeded.
        for r in d.requests() {
            assert_eq!(
                r.body["kv_transfer_params"]["remote_engine_id"],
                "engine-P2"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_rotate_and_routing_headers_name_the_workers() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let w = Double::start(Role::Decode, "W").await;
        let mut config = pd_config(&[&p], &[]);
        config.expose_routing = true;
        config.admin_api_key = Some("k".into());
        let gw = Gateway::start(config).await;
        let resp = client()
            .post(gw.at("/instances"))
            .header("x-api-key", "k")
            .json(&json!({"role": "decode", "url": d.url, "dp_size": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        for _ in 0..4 {
            let resp = post_chat(&gw, false).await;
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["x-pdserve-prefill"], p.url.as_str());
            assert_eq!(resp.headers()["x-pdserve-decode"], d.url.as_str());
        }
        let ranks: Vec<_> = d
            .requests()
            .iter()
            .map(|r| {
                r.headers["x-data-parallel-rank"]
                    .to_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(ranks, ["0", "1", "2", "0"]);
        assert!(
            p.requests()
                .iter()
                .all(|r| !r.headers.contains_key("x-data-parallel-rank")),
            "a single-replica worker is not given a rank"
        );

        // A prefill_decode worker is named in x-pdserve-worker; off without the flag.
        let mut config = crate::GatewayConfig::new(vec![], vec![], urls(&[&w]));
        config.expose_routing = true;
        let agg = Gateway::start(config).await;
        let resp = client()
            .post(agg.at("/v1/completions"))
            .json(&json!({"prompt": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-pdserve-worker"], w.url.as_str());
        let quiet = Gateway::start(crate::GatewayConfig::new(vec![], vec![], urls(&[&w]))).await;
        let resp = client()
            .post(quiet.at("/v1/completions"))
            .json(&json!({"prompt": "x"}))
            .send()
            .await
            .unwrap();
        assert!(resp.headers().get("x-pdserve-worker").is_none());
    })
    .await;
}

/// A gateway with `--disagg-threshold 64` and `--disagg-min-prefill-load min_load` over
/// one prefill and one decode double.
async fn threshold_pair(min_load: u32) -> (Double, Double, Gateway) {
    let p = Double::start(Role::Prefill, "P").await;
    let d = Double::start(Role::Decode, "D").await;
    let mut config = pd_config(&[&p], &[&d]);
    config.disagg_threshold = Some(64);
    config.disagg_min_prefill_load = min_load;
    let gw = Gateway::start(config).await;
    (p, d, gw)
}

/// A short chat prompt (~10 tokens) to `gw`; its status.
fn ask_short(gw: &Gateway) -> impl std::future::Future<Output = reqwest::StatusCode> + 'static {
    let url = gw.at("/v1/chat/completions");
    async move {
        client()
            .post(url)
            .json(
                &json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                          "max_tokens": 3}),
            )
            .send()
            .await
            .unwrap()
            .status()
    }
}

/// Checks `gw`'s counts of requests that skipped the prefill leg and that were handed off.
async fn assert_disaggregation(gw: &Gateway, skipped: u32, disaggregated: u32) {
    let text = metrics(gw).await;
    for needle in [
        format!(r#"pdserve_gateway_disaggregation_total{{outcome="prefill_skipped"}} {skipped}"#),
        format!(
            r#"pdserve_gateway_disaggregation_total{{outcome="disaggregated"}} {disaggregated}"#
        ),
    ] {
        assert!(text.contains(&needle), "missing {needle} in {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_disaggregation_sends_short_prompts_straight_to_decode() {
    bounded(async {
        let (p, d, gw) = threshold_pair(0).await;
        let ask = |content: String, stream: bool| {
            let url = gw.at("/v1/chat/completions");
            async move {
                let resp = client()
                    .post(url)
                    .json(&json!({"messages": [{"role": "user", "content": content}],
                                  "stream": stream, "max_tokens": 3}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                resp.text().await.unwrap()
            }
        };
        // ~10 tokens: no handoff.
        for stream in [false, true] {
            assert!(ask("What is the capital of France?".into(), stream)
                .await
                .contains("tok2"));
        }
        assert!(
            p.requests().is_empty(),
            "short prompts skip the prefill leg"
        );
        assert_eq!(d.requests().len(), 2);
        assert!(d
            .requests()
            .iter()
            .all(|r| r.body.get("kv_transfer_params").is_none()));
        // ~500 tokens: prefill, then decode with P's handle.
        let long = "The quick brown fox jumps over the lazy dog. ".repeat(45);
        assert!(ask(long, false).await.contains("tok2"));
        assert_eq!(p.requests().len(), 1);
        assert_eq!(
            d.requests()[2].body["kv_transfer_params"]["remote_engine_id"],
            "engine-P"
        );
        assert_disaggregation(&gw, 2, 1).await;
    })
    .await;
}

/// A decode worker computes one skipped prompt at a time (it stalls the streams it
/// serves while it does): a short prompt that comes while D is still answering the
/// last one gets a prefill leg; once D's answer has come, the next one skips again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_prefills_one_short_prompt_at_a_time() {
    bounded(async {
        let (p, d, gw) = threshold_pair(0).await;
        let ask = || ask_short(&gw);
        d.set(Behavior::Delay(Duration::from_millis(1500)));
        let first = tokio::spawn(ask());
        d.wait_for_requests(1).await;
        assert_eq!(ask().await, 200);
        assert_eq!(
            p.requests().len(),
            1,
            "D was busy with a prompt: a prefill leg"
        );
        assert_eq!(first.await.unwrap(), 200);
        d.set(Behavior::Normal);
        assert_eq!(ask().await, 200);
        assert_eq!(p.requests().len(), 1, "D's turn came back with its answer");
        assert_disaggregation(&gw, 2, 1).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_min_prefill_load_keeps_short_prompts_on_an_idle_prefill_worker() {
    bounded(async {
        let (p, d, gw) = threshold_pair(1).await;
        let ask = || ask_short(&gw);
        // P is idle: the short prompt still gets its handoff.
        assert_eq!(ask().await, 200);
        assert_eq!(p.requests().len(), 1);
        assert_eq!(
            d.requests()[0].body["kv_transfer_params"]["remote_engine_id"],
            "engine-P"
        );
        // P is busy with a slow prefill leg: the next short prompt is prefilled on D.
        p.set(Behavior::Delay(Duration::from_millis(1500)));
        let slow = tokio::spawn(ask());
        p.wait_for_requests(2).await;
        assert_eq!(ask().await, 200);
        assert_eq!(p.requests().len(), 2, "the busy prefill worker got no leg");
        assert!(d.requests()[1].body.get("kv_transfer_params").is_none());
        assert_eq!(slow.await.unwrap(), 200);
        assert_eq!(
            d.requests()[2].body["kv_transfer_params"]["remote_engine_id"],
            "engine-P"
        );
        assert_disaggregation(&gw, 1, 2).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_every_turn_of_a_conversation_on_its_first_workers() {
    bounded(async {
        let p1 = Double::start(Role::Prefill, "P1").await;
        let p2 = Double::start(Role::Prefill, "P2").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let mut config = pd_config(&[&p1, &p2], &[&d1, &d2]);
        config.policy = "cache_aware".into();
        config.expose_routing = true;
        let gw = Gateway::start(config).await;
        let conversations = 8;
        let mut history: Vec<Vec<Value>> = (0..conversations)
            .map(|c| {
                vec![json!({"role": "system",
                    "content": format!("You are assistant number {c}. {}", "Be brief and exact. ".repeat(10))})]
            })
            .collect();
        let mut routes: Vec<Vec<(String, String)>> = vec![Vec::new(); conversations];
        for turn in 0..3 {
            for c in 0..conversations {
                history[c].push(json!({"role": "user", "content": format!("question {turn} of {c}")}));
                let resp = client()
                    .post(gw.at("/v1/chat/completions"))
                    .json(&json!({"messages": history[c], "max_tokens": 3}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let h = resp.headers();
                let route = (
                    h["x-pdserve-prefill"].to_str().unwrap().to_string(),
                    h["x-pdserve-decode"].to_str().unwrap().to_string(),
                );
                routes[c].push(route);
                let body: Value = resp.json().await.unwrap();
                history[c].push(body["choices"][0]["message"].clone());
            }
        }
        for (c, r) in routes.iter().enumerate() {
            assert!(r.iter().all(|x| x == &r[0]), "conversation {c} moved: {r:?}");
        }
        // Load stayed balanced: both prefill and both decode workers own conversations.
        for url in [&p1.url, &p2.url] {
            assert!(routes.iter().any(|r| &r[0].0 == url), "{url} got nothing: {routes:?}");
        }
        for url in [&d1.url, &d2.url] {
            assert!(routes.iter().any(|r| &r[0].1 == url), "{url} got nothing: {routes:?}");
        }
        let text = metrics(&gw).await;
        assert!(text.contains(r#"pdserve_gateway_policy_cache_hits{role="decode"} 16"#), "{text}");
    })
    .await;
}
