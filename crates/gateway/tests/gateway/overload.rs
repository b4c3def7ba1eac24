//! Overload control (`--max-concurrent-requests`, `--queue-size`,
//! `--queue-timeout-secs`): past the limit requests wait by priority (vLLM's `priority`
//! field or `x-pdserve-priority`, lower first), then arrival; a full queue is a 429 and a
//! wait that runs out a 408, both OpenAI-shaped with `Retry-After`, and counted.

use std::time::Duration;

use serde_json::json;

use super::double::{Behavior, Double, Role};
use super::{bounded, client, metric, pd_config, Gateway};

fn body(prompt: &str) -> serde_json::Value {
    json!({"prompt": prompt, "max_tokens": 2})
}

async fn limited(running: usize, waiting: usize, timeout: Duration) -> (Double, Double, Gateway) {
    let p = Double::start(Role::Prefill, "p").await;
    let d = Double::start(Role::Decode, "d").await;
    let mut config = pd_config(&[&p], &[&d]);
    config.max_concurrent_requests = running;
    config.queue_size = waiting;
    config.queue_timeout = timeout;
    let gateway = Gateway::start(config).await;
    (p, d, gateway)
}

#[tokio::test]
async fn queued_requests_go_by_priority_and_a_full_queue_is_a_429() {
    bounded(async {
        let (_p, d, gateway) = limited(1, 2, Duration::from_secs(20)).await;
        d.set(Behavior::Delay(Duration::from_millis(400)));
        let post = |prompt: &'static str, priority: Option<i64>, header: Option<&'static str>| {
            let mut request = client().post(gateway.at("/v1/completions"));
            let mut b = body(prompt);
            if let Some(p) = priority {
                b["priority"] = json!(p);
            }
            if let Some(h) = header {
                request = request.header("x-pdserve-priority", h);
            }
            request.json(&b).send()
        };
        let first = tokio::spawn(post("first", None, None));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let low = tokio::spawn(post("low", Some(5), None));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let high = tokio::spawn(post("high", None, Some("-1")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Running 1, queued 2: the next is refused at once.
        let refused = post("refused", None, None).await.unwrap();
        assert_eq!(refused.status(), 429);
        let retry_after = refused.headers().get("retry-after").expect("Retry-After");
        assert!(retry_after.to_str().unwrap().parse::<u64>().unwrap() >= 1);
        let error: serde_json::Value = refused.json().await.unwrap();
        assert!(error["error"]["message"].is_string(), "{error}");
        for task in [first, low, high] {
            assert_eq!(task.await.unwrap().unwrap().status(), 200);
        }
        let order: Vec<String> = d
            .requests()
            .iter()
            .map(|r| r.body["prompt"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            order,
            ["first", "high", "low"],
            "the higher priority went first"
        );
        assert_eq!(
            metric(
                &gateway,
                r#"pdserve_gateway_rejected_requests_total{reason="queue_full"}"#
            )
            .await,
            1.0
        );
        assert_eq!(metric(&gateway, "pdserve_gateway_queue_depth").await, 0.0);
    })
    .await;
}

#[tokio::test]
async fn a_request_that_waits_too_long_is_a_408() {
    bounded(async {
        let (_p, d, gateway) = limited(1, 4, Duration::from_millis(200)).await;
        d.set(Behavior::Delay(Duration::from_millis(1500)));
        let running = tokio::spawn(
            client()
                .post(gateway.at("/v1/completions"))
                .json(&body("running"))
                .send(),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let late = client()
            .post(gateway.at("/v1/completions"))
            .json(&body("late"))
            .send()
            .await
            .unwrap();
        assert_eq!(late.status(), 408);
        assert!(late.headers().contains_key("retry-after"));
        let error: serde_json::Value = late.json().await.unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("queue"),
            "{error}"
        );
        assert_eq!(running.await.unwrap().unwrap().status(), 200);
        assert_eq!(
            metric(
                &gateway,
                r#"pdserve_gateway_rejected_requests_total{reason="queue_timeout"}"#
            )
            .await,
            1.0
        );
    })
    .await;
}

#[tokio::test]
async fn responses_and_sglang_generate_wait_in_the_same_queue() {
    bounded(async {
        let p = Double::start(Role::Prefill, "p").await;
        let d = Double::start(Role::Decode, "d").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.max_concurrent_requests = 1;
        config.queue_size = 0;
        config.protocol = pdserve_gateway::config::Protocol::Sglang;
        let gateway = Gateway::start(config).await;
        d.set(Behavior::Delay(Duration::from_millis(400)));
        let busy = tokio::spawn(
            client()
                .post(gateway.at("/v1/completions"))
                .json(&body("busy"))
                .send(),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (path, request) in [
            ("/v1/responses", json!({"input": "hi", "priority": -5})),
            ("/generate", json!({"text": "hi", "priority": -5})),
        ] {
            let refused = client()
                .post(gateway.at(path))
                .json(&request)
                .send()
                .await
                .unwrap();
            assert_eq!(refused.status(), 429, "{path}");
            assert!(refused.headers().get("retry-after").is_some(), "{path}");
        }
        let bad = client()
            .post(gateway.at("/generate"))
            .json(&json!({"text": "hi", "priority": "soon"}))
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 400, "a priority that is not an integer");
        assert_eq!(busy.await.unwrap().unwrap().status(), 200);
        assert_eq!(
            metric(
                &gateway,
                r#"pdserve_gateway_rejected_requests_total{reason="queue_full"}"#
            )
            .await,
            2.0
        );
    })
    .await;
}
