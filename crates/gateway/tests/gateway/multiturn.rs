//! Multi-turn KV reuse: D's final params go to P on the conversation's next turn.

use std::time::Duration;

use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, pd_config, Gateway};

fn miss_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// D's handle from a finished turn, as P must receive it on the next turn.
fn handed_back(d: &Double, request_id: &str) -> Value {
    let mut v = d.kv_handle(request_id);
    v["do_remote_decode"] = json!(true);
    v["do_remote_prefill"] = json!(false);
    v
}

async fn turn(gw: &Gateway, request_id: &str, stream: bool) -> reqwest::StatusCode {
    let resp = client()
        .post(gw.at("/v1/chat/completions"))
        .header("x-request-id", request_id)
        .json(&json!({
            "model": "m",
            "messages": [{"role": "user", "content": format!("turn {request_id}")}],
            "conversation_id": "conv-1",
            "stream": stream,
            "max_tokens": 2
        }))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    if stream && status == 200 {
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_params_are_handed_to_the_next_prefill_once() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;

        // Turn 1 (streamed): a miss; D's last chunk carries its handle.
        assert_eq!(turn(&gw, "t1", true).await, 200);
        assert_eq!(gw.health().await["cached_conversations"], 1);

        // Turn 2 (not streamed): P reads D's turn-1 blocks.
        assert_eq!(turn(&gw, "t2", false).await, 200);
        // Turn 3: P gets turn 2's handle (from D's non-stream body), not turn 1's.
        assert_eq!(turn(&gw, "t3", true).await, 200);

        let prefills = p.requests();
        assert_eq!(prefills.len(), 3);
        assert_eq!(prefills[0].body["kv_transfer_params"], miss_params());
        assert_eq!(
            prefills[1].body["kv_transfer_params"],
            handed_back(&d, "t1")
        );
        assert_eq!(
            prefills[2].body["kv_transfer_params"],
            handed_back(&d, "t2")
        );
        // The gateway's own field is never forwarded.
        for r in prefills.iter().chain(d.requests().iter()) {
            assert!(r.body.get("conversation_id").is_none(), "{:?}", r.body);
        }
        // Each decode still gets its own prefill's handle.
        for (i, r) in d.requests().iter().enumerate() {
            assert_eq!(
                r.body["kv_transfer_params"],
                p.kv_handle(&format!("t{}", i + 1))
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_is_used_once_even_when_the_turn_fails() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        assert_eq!(turn(&gw, "t1", false).await, 200);
        p.set(Behavior::Status(
            400,
            r#"{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}"#,
        ));
        assert_eq!(turn(&gw, "t2", false).await, 400);
        p.set(Behavior::Normal);
        assert_eq!(turn(&gw, "t3", false).await, 200);
        let prefills = p.requests();
        assert_eq!(
            prefills[1].body["kv_transfer_params"],
            handed_back(&d, "t1")
        );
        assert_eq!(prefills[2].body["kv_transfer_params"], miss_params());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_expires_after_the_ttl() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.conversation_ttl = Duration::from_millis(300);
        let gw = Gateway::start(config).await;
        assert_eq!(turn(&gw, "t1", true).await, 200);
        assert_eq!(gw.health().await["cached_conversations"], 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(gw.health().await["cached_conversations"], 0);
        assert_eq!(turn(&gw, "t2", true).await, 200);
        assert_eq!(p.requests()[1].body["kv_transfer_params"], miss_params());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_conversation_id_cache_nothing() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "x"}], "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
        assert_eq!(gw.health().await["cached_conversations"], 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_prefill_cannot_read_the_last_turn_is_prefilled_in_full() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        assert_eq!(turn(&gw, "t1", false).await, 200);
        // The last turn's blocks are gone: P answers 502 reading them, once.
        p.set(Behavior::StatusTimes(
            502,
            r#"{"error":{"message":"KV read failed"}}"#,
            1,
        ));
        assert_eq!(turn(&gw, "t2", false).await, 200);
        let bodies: Vec<Value> = p.requests().iter().map(|r| r.body.clone()).collect();
        assert_eq!(bodies.len(), 3, "{bodies:?}");
        assert_eq!(bodies[1]["kv_transfer_params"], handed_back(&d, "t1"));
        assert_eq!(bodies[2]["kv_transfer_params"], miss_params());
        let fallbacks =
            crate::metric(&gw, "pdserve_gateway_conversation_cache_fallbacks_total").await;
        assert_eq!(fallbacks, 1.0);
        // A 4xx is the request's own fault: passed through, not retried without the KV.
        assert_eq!(turn(&gw, "t3", false).await, 200);
        p.set(Behavior::StatusTimes(
            400,
            r#"{"error":{"message":"bad"}}"#,
            1,
        ));
        assert_eq!(turn(&gw, "t4", false).await, 400);
    })
    .await;
}
