//! Encoder disaggregation when things fail: encoder errors, decode 500s (re-encode and
//! retry), missing encoders; text-only requests; the profiling fan-out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::double::{Behavior as WorkerBehavior, Double, Role};
use crate::encoder::{Behavior, Encoder};
use crate::epd::{chat, epd_gateway, image, mm_request};
use crate::{bounded, client, pd_config, sse_data, Gateway};

const OPENAI_400: &str =
    r#"{"error":{"message":"image too large","type":"BadRequestError","param":null,"code":400}}"#;

#[tokio::test]
async fn an_encoder_failure_fails_the_request_fast_and_cancels_the_other_sub_requests() {
    bounded(async {
        let (slow, failing) = (Encoder::start("slow").await, Encoder::start("bad").await);
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&slow, &failing], &[], &[], &[&worker], |_| {}).await;
        // The failing encoder answers once the slow one holds its part: else, on a busy
        // machine, the failure could come before the slow sub-request arrived, and there
        // would be nothing in flight to cancel.
        let held = Arc::new(tokio::sync::Notify::new());
        slow.set(Behavior::HoldSignalling(held.clone()));
        failing.set(Behavior::StatusAfter(500, "encoder exploded", held));
        let started = Instant::now();
        let (status, body) =
            chat(&gateway, "r", &mm_request(&[image("a"), image("b")], false)).await;
        assert_eq!(status, 502, "{body}");
        assert!(body.contains("encoder exploded"), "{body}");
        assert!(started.elapsed() < Duration::from_secs(5));
        slow.wait_for_cancel().await;
        assert!(worker.requests().is_empty(), "nothing reaches the worker");

        // An encoder's 4xx reaches the client as it is.
        slow.set(Behavior::Normal);
        failing.set(Behavior::Status(400, OPENAI_400));
        let (status, body) =
            chat(&gateway, "r", &mm_request(&[image("a"), image("b")], false)).await;
        assert_eq!((status, body.as_str()), (400, OPENAI_400));
    })
    .await;
}

#[tokio::test]
async fn a_decode_500_before_the_first_byte_encodes_again_and_retries() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let prefill = Double::start(Role::Prefill, "p").await;
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = epd_gateway(&[&encoder], &[&prefill], &[&decode], &[], |_| {}).await;
        decode.set(WorkerBehavior::StatusTimes(500, "embedding not found", 1));
        let (status, body) = chat(&gateway, "r", &mm_request(&[image("a")], true)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(sse_data(&body).last().map(String::as_str), Some("[DONE]"));
        assert_eq!(encoder.requests().len(), 2, "encoded again");
        assert_eq!(prefill.requests().len(), 2);
        assert_eq!(decode.requests().len(), 2);
        let ids: Vec<_> = encoder
            .requests()
            .iter()
            .map(|r| r.headers["x-request-id"].clone())
            .collect();
        assert_ne!(ids[0], ids[1], "each encoding is its own child request");

        // After the first byte nothing is redone: the stream ends with an error event.
        decode.set(WorkerBehavior::FailMidStream);
        let (status, body) = chat(&gateway, "r2", &mm_request(&[image("a")], true)).await;
        assert_eq!(status, 200);
        assert!(body.contains("error"), "{body}");
        assert_eq!(encoder.requests().len(), 3);

        // Other failures of decode are retried on the leg alone; a 4xx is final.
        decode.set(WorkerBehavior::Status(400, OPENAI_400));
        let (status, _) = chat(&gateway, "r3", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 400);
        assert_eq!(encoder.requests().len(), 4);
    })
    .await;
}

#[tokio::test]
async fn e_pd_reencodes_after_a_500_and_gives_up_after_max_retries() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |c| c.max_retries = 1).await;
        worker.set(WorkerBehavior::StatusTimes(500, "embedding not found", 1));
        let (status, body) = chat(&gateway, "r", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!((encoder.requests().len(), worker.requests().len()), (2, 2));

        worker.set(WorkerBehavior::Status(500, "still broken"));
        let (status, body) = chat(&gateway, "r", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 502, "{body}");
        assert!(body.contains("still broken"), "{body}");
        assert_eq!((encoder.requests().len(), worker.requests().len()), (4, 4));
    })
    .await;
}

#[tokio::test]
async fn text_only_requests_never_touch_the_encoders() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let prefill = Double::start(Role::Prefill, "p").await;
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = epd_gateway(&[&encoder], &[&prefill], &[&decode], &[], |_| {}).await;
        let text_parts = json!({"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        let plain =
            json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        for body in [&text_parts, &plain] {
            assert_eq!(chat(&gateway, "t", body).await.0, 200);
        }
        let completion = client()
            .post(gateway.at("/v1/completions"))
            .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(completion.status(), 200);
        assert!(encoder.requests().is_empty());
        assert_eq!(decode.requests().len(), 3);
        assert_eq!(
            decode.requests()[0].body["messages"],
            text_parts["messages"]
        );
    })
    .await;
}

#[tokio::test]
async fn media_without_an_encoder_is_503_with_the_reason() {
    bounded(async {
        let prefill = Double::start(Role::Prefill, "p").await;
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = Gateway::start(pd_config(&[&prefill], &[&decode])).await;
        let (status, body) = chat(&gateway, "r", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 503, "{body}");
        let message = serde_json::from_str::<Value>(&body).unwrap()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(message.contains("1 media item(s) (image_url)"), "{message}");
        assert!(
            message.contains("no encode worker is registered"),
            "{message}"
        );
        assert!(prefill.requests().is_empty() && decode.requests().is_empty());
    })
    .await;
}

async fn profile(gateway: &Gateway, command: &str) -> (u16, Value) {
    let response = client()
        .post(gateway.at(&format!("/{command}_profile")))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn profiling_goes_to_one_instance_per_role_and_tolerates_404s() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let (p0, p1) = (
            Double::start(Role::Prefill, "p0").await,
            Double::start(Role::Prefill, "p1").await,
        );
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = epd_gateway(&[&encoder], &[&p0, &p1], &[&decode], &[], |_| {}).await;
        // Profiling is off everywhere: every instance answers 404.
        let (status, body) = profile(&gateway, "start").await;
        assert_eq!(status, 503, "{body}");

        p0.set_profiling(true);
        p1.set_profiling(true);
        let (status, body) = profile(&gateway, "start").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body, json!({"prefill": {}, "decode": null, "encode": null}));
        decode.set_profiling(true);
        let (status, body) = profile(&gateway, "stop").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body, json!({"prefill": {}, "decode": {}, "encode": null}));
        // One instance per role and call.
        let calls = |d: &Double| {
            d.requests()
                .iter()
                .filter(|r| r.path.ends_with("_profile"))
                .count()
        };
        assert_eq!(calls(&p0) + calls(&p1), 3);
        assert_eq!(calls(&decode), 3);
        assert_eq!(decode.requests().last().unwrap().path, "/stop_profile");
    })
    .await;
}

#[tokio::test]
async fn decode_failures_share_one_retry_budget_with_the_encoder_stage() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let prefill = Double::start(Role::Prefill, "p").await;
        let d0 = Double::start(Role::Decode, "d0").await;
        let d1 = Double::start(Role::Decode, "d1").await;
        let gateway = epd_gateway(&[&encoder], &[&prefill], &[&d0, &d1], &[], |c| {
            c.max_retries = 3
        })
        .await;
        for d in [&d0, &d1] {
            d.set(WorkerBehavior::Status(503, "busy"));
        }
        let (status, body) = chat(&gateway, "r", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 502, "{body}");
        // A decode failure that is not a 500 retries the decode leg alone, on the other
        // decode worker; with none left the request ends: one encoding, one prefill.
        let decodes = d0.requests().len() + d1.requests().len();
        assert_eq!(decodes, 2, "each decode worker once");
        assert_eq!((encoder.requests().len(), prefill.requests().len()), (1, 1));

        // 500s re-encode, and every attempt of any stage counts against one budget.
        for d in [&d0, &d1] {
            d.set(WorkerBehavior::Status(500, "embedding not found"));
        }
        let (status, _) = chat(&gateway, "r2", &mm_request(&[image("a")], false)).await;
        assert_eq!(status, 502);
        let decodes = d0.requests().len() + d1.requests().len() - 2;
        assert_eq!(decodes, 4, "1 + --max-retries decode attempts in all");
        assert_eq!(encoder.requests().len() - 1, 4);
    })
    .await;
}
