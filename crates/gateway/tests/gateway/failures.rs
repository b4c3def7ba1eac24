//! Every failure row: each request ends in bounded time with an OpenAI-shaped error.

use std::time::Duration;

use futures::StreamExt;
use pdserve_gateway::fleet::registry::parse_worker_url;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, pd_config, sse_data, urls, Gateway};

const VLLM_400: &str = r#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":null,"code":400}}"#;

/// A chat request. Its streams do not take their first token from the prefill leg: these
/// rows are about what a client gets before any byte was sent (with the prefill's token
/// sent first, a decode failure is an error event in the stream: `first_token.rs`).
fn chat(stream: bool) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "stream": stream, "max_tokens": 3});
    if stream {
        body["first_token_from_prefill"] = json!(false);
    }
    body
}

/// Posts `body` and returns the status and the JSON error body.
async fn post_error(gw: &Gateway, body: &Value) -> (u16, Value) {
    let resp = client()
        .post(gw.at("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.expect("error bodies are JSON");
    (status, body)
}

fn assert_openai_error(body: &Value, kind: &str) {
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], kind, "{body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{body}"
    );
}

/// A URL nothing listens on.
async fn dead_url() -> reqwest::Url {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    parse_worker_url("test", &url).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_mistyped_bodies_get_400_without_touching_workers() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        for (path, body) in [
            ("/v1/chat/completions", "{\"messages\": ["),
            ("/v1/chat/completions", "{\"messages\": \"hi\"}"),
            (
                "/v1/chat/completions",
                "{\"messages\": [], \"max_tokens\": \"ten\"}",
            ),
            ("/v1/completions", "{\"model\": \"m\"}"),
            (
                "/v1/completions",
                "{\"prompt\": \"x\", \"conversation_id\": 7}",
            ),
            ("/v1/completions", ""),
        ] {
            let resp = client()
                .post(gw.at(path))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400, "{body}");
            assert_openai_error(&resp.json().await.unwrap(), "invalid_request_error");
        }
        assert!(p.requests().is_empty() && d.requests().is_empty());
        let resp = client().get(gw.at("/v1/nope")).send().await.unwrap();
        assert_eq!(resp.status(), 404);
        assert_openai_error(&resp.json().await.unwrap(), "not_found_error");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.max_body_bytes = 1024;
        let gw = Gateway::start(config).await;
        let big = json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]});
        let (status, body) = post_error(&gw, &big).await;
        assert_eq!(status, 413);
        assert_openai_error(&body, "invalid_request_error");
        assert!(p.requests().is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_roles_get_503() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        for config in [
            GatewayConfig::new(urls(&[&p]), vec![], vec![]),
            GatewayConfig::new(vec![], vec![], vec![]),
        ] {
            let gw = Gateway::start(config).await;
            let (status, body) = post_error(&gw, &chat(true)).await;
            assert_eq!(status, 503);
            assert_openai_error(&body, "server_error");
        }
        let gw = Gateway::start(GatewayConfig::new(vec![], vec![], vec![])).await;
        assert_eq!(
            client()
                .get(gw.at("/v1/models"))
                .send()
                .await
                .unwrap()
                .status(),
            503
        );
        assert!(p.requests().is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_4xx_is_passed_through_and_not_retried() {
    bounded(async {
        // Prefill 4xx: the same status and body; decode never called.
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        p.set(Behavior::Status(400, VLLM_400));
        let gw = Gateway::start(pd_config(&[&p], &[&d1, &d2])).await;
        let (status, body) = post_error(&gw, &chat(false)).await;
        assert_eq!(status, 400);
        assert_eq!(body, serde_json::from_str::<Value>(VLLM_400).unwrap());
        assert_eq!(p.requests().len(), 1);
        assert!(d1.requests().is_empty() && d2.requests().is_empty());

        // Decode 4xx: passed through, the other decode worker is not tried.
        p.set(Behavior::Normal);
        d1.set(Behavior::Status(400, VLLM_400));
        d2.set(Behavior::Status(400, VLLM_400));
        let (status, body) = post_error(&gw, &chat(true)).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"]["message"], "max_tokens is too large");
        assert_eq!(d1.requests().len() + d2.requests().len(), 1);

        // A non-JSON 4xx body is wrapped, keeping the status.
        d1.set(Behavior::Status(422, "unprocessable"));
        d2.set(Behavior::Status(422, "unprocessable"));
        let (status, body) = post_error(&gw, &chat(false)).await;
        assert_eq!(status, 422);
        assert_openai_error(&body, "invalid_request_error");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_5xx_garbage_or_unreachable_gets_502() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        for behavior in [
            Behavior::Status(500, "{\"error\":\"boom\"}"),
            Behavior::Garbage,
        ] {
            p.set(behavior);
            for stream in [false, true] {
                let (status, body) = post_error(&gw, &chat(stream)).await;
                assert_eq!(status, 502);
                assert_openai_error(&body, "server_error");
            }
        }
        assert!(d.requests().is_empty());

        let dead = Gateway::start(GatewayConfig::new(
            vec![dead_url().await],
            urls(&[&d]),
            vec![],
        ))
        .await;
        let (status, body) = post_error(&dead, &chat(true)).await;
        assert_eq!(status, 502);
        assert_openai_error(&body, "server_error");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_5xx_before_first_byte_is_retried_on_another_worker() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let bad = Double::start(Role::Decode, "BAD").await;
        let good = Double::start(Role::Decode, "GOOD").await;
        bad.set(Behavior::Status(500, "{\"error\":\"engine dead\"}"));
        let gw = Gateway::start(pd_config(&[&p], &[&bad, &good])).await;
        // Round-robin starts on `bad` for one of two requests; both must succeed.
        for stream in [true, false] {
            let resp = client()
                .post(gw.at("/v1/chat/completions"))
                .header("x-request-id", format!("r-{stream}"))
                .json(&chat(stream))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let text = resp.text().await.unwrap();
            assert!(text.contains("tok2"), "{text}");
        }
        assert_eq!(good.requests().len(), 2);
        assert!(!bad.requests().is_empty());
        // Each retry carries the same prefill handle and request id.
        for failed in bad.requests() {
            let rid = failed.headers["x-request-id"].to_str().unwrap().to_string();
            let again = good
                .requests()
                .into_iter()
                .find(|r| r.headers["x-request-id"] == rid.as_str())
                .unwrap();
            assert_eq!(again.body, failed.body);
        }
        assert_eq!(p.requests().len(), 2, "prefill is not repeated");

        // An unreachable decode worker is retried too.
        let dead = dead_url().await;
        let gw = Gateway::start(GatewayConfig::new(
            urls(&[&p]),
            vec![dead.clone(), urls(&[&good])[0].clone()],
            vec![],
        ))
        .await;
        for _ in 0..2 {
            let resp = client()
                .post(gw.at("/v1/chat/completions"))
                .json(&chat(true))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_5xx_without_another_worker_or_retries_gets_502() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        d1.set(Behavior::Status(503, "overloaded"));
        d2.set(Behavior::Status(500, "{\"error\":\"x\"}"));
        let gw = Gateway::start(pd_config(&[&p], &[&d1])).await;
        for stream in [true, false] {
            let (status, body) = post_error(&gw, &chat(stream)).await;
            assert_eq!(status, 502);
            assert_openai_error(&body, "server_error");
        }
        assert_eq!(d1.requests().len(), 2, "the only worker is not retried");

        let mut config = pd_config(&[&p], &[&d1, &d2]);
        config.max_retries = 0;
        let gw = Gateway::start(config).await;
        let (status, _) = post_error(&gw, &chat(true)).await;
        assert_eq!(status, 502);
        assert_eq!(d1.requests().len() + d2.requests().len(), 3);

        // An empty stream (no byte at all) and a garbage JSON body are failures too.
        d1.set(Behavior::EmptyStream);
        let gw = Gateway::start(pd_config(&[&p], &[&d1])).await;
        assert_eq!(post_error(&gw, &chat(true)).await.0, 502);
        d1.set(Behavior::Garbage);
        assert_eq!(post_error(&gw, &chat(false)).await.0, 502);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_failing_mid_stream_ends_with_an_error_event() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::FailMidStream);
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        let data = sse_data(&text);
        assert!(data[1].contains("tok0"), "{text}");
        let error: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert_openai_error(&error, "server_error");
        assert_eq!(data.last().unwrap(), "[DONE]");
        assert_eq!(
            d.requests().len(),
            1,
            "nothing is retried after the first byte"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leg_timeouts_get_504_and_idle_streams_end_with_an_error() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.prefill_timeout = Duration::from_millis(200);
        config.decode_timeout = Duration::from_millis(200);
        config.stream_idle_timeout = Duration::from_millis(200);
        let gw = Gateway::start(config).await;

        p.set(Behavior::Delay(Duration::from_secs(5)));
        let (status, body) = post_error(&gw, &chat(true)).await;
        assert_eq!(status, 504);
        assert_openai_error(&body, "server_error");
        assert!(d.requests().is_empty());
        // The timed-out prefill request was cancelled, not left running.
        p.wait_for_cancel().await;

        p.set(Behavior::Normal);
        d.set(Behavior::Delay(Duration::from_secs(5)));
        for stream in [true, false] {
            let (status, body) = post_error(&gw, &chat(stream)).await;
            assert_eq!(status, 504);
            assert_openai_error(&body, "server_error");
        }
        d.wait_for_cancel().await;

        // First token, then silence: the stream ends with an error event.
        d.set(Behavior::Gated);
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let data = sse_data(&resp.text().await.unwrap());
        assert!(data[1].contains("tok0"));
        let error: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert_eq!(error["error"]["code"], "upstream_timeout");
        assert_eq!(data.last().unwrap(), "[DONE]");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_prefill_leg() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        p.set(Behavior::Hold);
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let url = gw.at("/v1/chat/completions");
        let request = tokio::spawn(async move {
            client()
                .post(url)
                .json(&chat(true))
                .send()
                .await
                .map(|r| r.status())
        });
        p.wait_for_requests(1).await;
        request.abort();
        p.wait_for_cancel().await;
        assert_eq!(p.cancelled(), 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            d.requests().is_empty(),
            "no decode leg after the client left"
        );
        assert_eq!(gw.in_flight(&p.url).await, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_the_decode_leg() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::Hold);
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let mut seen = 0;
        while seen < 3 {
            body.next().await.unwrap().unwrap();
            seen += 1;
        }
        assert_eq!(
            d.cancelled(),
            0,
            "the stream is live while the client reads"
        );
        drop(body);
        d.wait_for_cancel().await;
        assert_eq!(d.cancelled(), 1);
        // Give the gateway a moment to drop its in-flight count.
        for _ in 0..100 {
            if gw.in_flight(&d.url).await == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the decode leg still counts as in flight");
    })
    .await;
}
