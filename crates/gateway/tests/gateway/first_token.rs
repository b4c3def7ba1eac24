//! The first token from the prefill leg (`--first-token-from-prefill`): sent at once,
//! taken out of the decode stream only when equal, a decode worker that lies ends the
//! stream with an error event, and a decode leg that fails after it is never silent.

use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, metric, pd_config, sse_data, Gateway};

const FROM_PREFILL: &str = "pdserve_gateway_first_token_from_prefill_total";
const MISMATCH: &str = "pdserve_gateway_first_token_mismatch_total";

/// A streamed chat's events through `gw`, as JSON (`[DONE]` kept as a string).
async fn stream_chat(gw: &Gateway, extra: Value) -> Vec<Value> {
    let mut body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": true,
        "max_tokens": 3,
        "temperature": 0,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let resp = client()
        .post(gw.at("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    sse_data(&text)
        .into_iter()
        .map(|d| serde_json::from_str(&d).unwrap_or(Value::String(d)))
        .collect()
}

fn contents(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_token_leads_and_the_decode_repeat_is_taken_out() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;

        let events = stream_chat(&gw, json!({})).await;
        assert_eq!(contents(&events), ["tok0", "tok1", "tok2"], "{events:?}");
        // One role event, first; one id (the prefill answer's) throughout.
        let roles = events
            .iter()
            .filter(|e| e["choices"][0]["delta"]["role"] == "assistant")
            .count();
        assert_eq!(roles, 1, "{events:?}");
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(events[1]["choices"][0]["delta"]["content"], "tok0");
        let ids: Vec<&Value> = events.iter().filter_map(|e| e.get("id")).collect();
        assert!(ids.iter().all(|id| *id == ids[0]), "{events:?}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert_eq!(metric(&gw, FROM_PREFILL).await, 1.0);

        // Turned off per request: the decode stream as it is.
        let events = stream_chat(&gw, json!({"first_token_from_prefill": false})).await;
        assert_eq!(contents(&events), ["tok0", "tok1", "tok2"]);
        assert_eq!(metric(&gw, FROM_PREFILL).await, 1.0);
        let forwarded = d.requests().last().unwrap().body.clone();
        assert!(forwarded.get("first_token_from_prefill").is_none());

        // Not eligible: a stop string could hold the token back.
        let events = stream_chat(&gw, json!({"stop": ["zz"]})).await;
        assert_eq!(contents(&events), ["tok0", "tok1", "tok2"]);
        assert_eq!(metric(&gw, FROM_PREFILL).await, 1.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_request_gets_one_seed_on_both_legs() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        stream_chat(&gw, json!({"temperature": 0.8})).await;
        let seed = p.only_request().body["seed"].clone();
        assert!(seed.is_u64(), "{seed}");
        assert_eq!(d.only_request().body["seed"], seed);
        // The client's own seed is left alone.
        stream_chat(&gw, json!({"temperature": 0.8, "seed": 7})).await;
        assert_eq!(p.requests().last().unwrap().body["seed"], 7);
        assert_eq!(d.requests().last().unwrap().body["seed"], 7);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_does_not_continue_from_the_token_ends_the_stream() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::FirstToken("other"));
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let events = stream_chat(&gw, json!({})).await;
        assert_eq!(contents(&events), ["tok0"], "{events:?}");
        let error = events
            .iter()
            .find(|e| e.get("error").is_some())
            .unwrap_or_else(|| panic!("no error event: {events:?}"));
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("\"tok0\"") && message.contains("\"other\""),
            "{message}"
        );
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert_eq!(metric(&gw, MISMATCH).await, 1.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_token_reaches_the_client_before_the_decode_worker_answers() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        // The decode worker does not answer until the client already read the token.
        d.set(Behavior::Delay(std::time::Duration::from_secs(20)));
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let mut resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(
                &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "stream": true, "max_tokens": 3, "temperature": 0}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut got = String::new();
        while !got.contains("tok0") {
            let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), resp.chunk())
                .await
                .expect("the prefill's token waited for the decode worker")
                .unwrap()
                .expect("the stream ended before the token");
            got.push_str(&String::from_utf8_lossy(&chunk));
        }
        tokio::time::timeout(std::time::Duration::from_secs(10), d.wait_for_requests(1))
            .await
            .expect("the decode leg was not sent");
        assert_eq!(metric(&gw, FROM_PREFILL).await, 1.0);
        // The client leaves: the decode leg waiting for its answer is dropped (and with
        // it the prefill's KV handle, released as on any decode failure).
        drop(resp);
        tokio::time::timeout(std::time::Duration::from_secs(10), d.wait_for_cancel())
            .await
            .expect("the decode leg outlived the client");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_leg_that_fails_after_the_token_ends_with_an_error_event() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        // The decode worker refuses (its KV read failed): the token was already sent, so
        // the stream ends with the worker's error, never a silent cut.
        d.set(Behavior::Status(500, r#"{"error":{"message":"boom"}}"#));
        let events = stream_chat(&gw, json!({})).await;
        assert_eq!(contents(&events), ["tok0"], "{events:?}");
        let error = events
            .iter()
            .find(|e| e.get("error").is_some())
            .unwrap_or_else(|| panic!("cut silently: {events:?}"));
        assert!(error["error"]["message"].is_string(), "{error}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        // It breaks off mid-stream: the same.
        d.set(Behavior::FailMidStream);
        let events = stream_chat(&gw, json!({})).await;
        assert_eq!(contents(&events), ["tok0"], "{events:?}");
        assert!(
            events.iter().any(|e| e.get("error").is_some()),
            "cut silently: {events:?}"
        );
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert_eq!(metric(&gw, FROM_PREFILL).await, 2.0);
    })
    .await;
}
