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
async fn a_decode_leg_that_fails_is_a_status_before_the_token_and_an_error_event_after() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        // Before the decode worker's head (its KV read failed): nothing was sent, the
        // client gets the status.
        d.set(Behavior::Status(500, r#"{"error":{"message":"boom"}}"#));
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(
                &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "stream": true, "max_tokens": 3, "temperature": 0}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 502);
        let body: Value = resp.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
        // After it: the prefill's token, then an error event, never a silent cut.
        d.set(Behavior::FailMidStream);
        let events = stream_chat(&gw, json!({})).await;
        assert_eq!(contents(&events), ["tok0"], "{events:?}");
        assert!(
            events.iter().any(|e| e.get("error").is_some()),
            "cut silently: {events:?}"
        );
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert_eq!(metric(&gw, FROM_PREFILL).await, 1.0);
    })
    .await;
}
