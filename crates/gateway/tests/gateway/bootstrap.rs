//! `--protocol sglang`: bootstrap fields, the fast path, and every way a leg can fail,
//! against doubles that follow SGLang's wire format.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use pdserve_gateway::config::Protocol;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::sglang_double::{rooms, Decode, Late, Link, Prefill, SglangDouble};
use crate::{bounded, client, sse_data, Gateway};

const ROOM_LIMIT: u64 = 1 << 63;

fn config(prefill: &[&SglangDouble], decode: &[&SglangDouble]) -> GatewayConfig {
    let urls = |ds: &[&SglangDouble]| {
        ds.iter()
            .map(|d| pdserve_gateway::fleet::registry::parse_worker_url("t", &d.url).unwrap())
            .collect()
    };
    let mut config = GatewayConfig::new(urls(prefill), urls(decode), Vec::new());
    config.protocol = Protocol::Sglang;
    config.prefill_bootstrap_ports = vec![Some(8998); prefill.len()];
    config.prefill_timeout = Duration::from_secs(1);
    config.max_retries = 0;
    config
}

/// One P and one D on a fresh link, and a gateway in front.
async fn stack(p: Prefill, d: Decode) -> (Arc<Link>, SglangDouble, SglangDouble, Gateway) {
    let link = Link::new();
    let prefill = SglangDouble::prefill(&link, p).await;
    let decode = SglangDouble::decode(&link, d).await;
    let gateway = Gateway::start(config(&[&prefill], &[&decode])).await;
    (link, prefill, decode, gateway)
}

fn chat(stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": 3, "stream": stream})
}

async fn post(gateway: &Gateway, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(gateway.at(path))
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn both_legs_get_one_body_with_sglang_bootstrap_fields() {
    bounded(async {
        let cases = [
            ("/v1/chat/completions", chat(false), None),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi"}], "n": 3}),
                Some(3),
            ),
            ("/v1/completions", json!({"prompt": "a", "n": 2}), None),
            (
                "/generate",
                json!({"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}}),
                Some(3),
            ),
            ("/generate", json!({"text": "a"}), None),
        ];
        let metrics = |gateway: &Gateway| {
            let url = gateway.at("/metrics");
            async move {
                client()
                    .get(url)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap()
            }
        };
        for (path, body, batch) in cases {
            let (_link, p, d, gateway) = stack(Prefill::Normal, Decode::Normal).await;
            let response = post(&gateway, path, &body).await;
            assert_eq!(response.status(), 200, "{path} {body}");
            let answer: Value = response.json().await.unwrap();
            assert!(answer.to_string().contains("tok0"), "{answer}");
            let metrics = metrics(&gateway).await;
            assert!(
                metrics
                    .contains(r#"pdserve_gateway_disaggregation_total{outcome="disaggregated"} 1"#),
                "{metrics}"
            );
            let (p_body, d_body) = (p.only_body(), d.only_body());
            assert_eq!(p_body, d_body, "P and D get the same body");
            assert_eq!(p.requests()[0].0, path);
            let host = &p_body["bootstrap_host"];
            let port = &p_body["bootstrap_port"];
            let rooms = rooms(&p_body);
            assert!(rooms.iter().all(|&r| r < ROOM_LIMIT), "{rooms:?}");
            match batch {
                None => {
                    assert_eq!(host, "127.0.0.1");
                    assert_eq!(port, 8998);
                    assert!(p_body["bootstrap_room"].is_u64());
                }
                Some(n) => {
                    assert_eq!(host, &json!(vec!["127.0.0.1"; n]), "{path} {body}");
                    assert_eq!(port, &json!(vec![8998; n]));
                    let distinct: std::collections::HashSet<_> = rooms.iter().collect();
                    assert_eq!((rooms.len(), distinct.len()), (n, n), "{rooms:?}");
                }
            }
        }

        // A completions batch goes as one request per prompt, each with its own room,
        // answered as one body with the choices in prompt order.
        let (_link, p, d, gateway) = stack(Prefill::Normal, Decode::Normal).await;
        let body = json!({"prompt": ["a", "b"], "max_tokens": 2});
        let response = post(&gateway, "/v1/completions", &body).await;
        assert_eq!(response.status(), 200);
        let answer: Value = response.json().await.unwrap();
        let indexes: Vec<&Value> = answer["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| &c["index"])
            .collect();
        assert_eq!(indexes, [&json!(0), &json!(1)], "{answer}");
        for leg in [p.requests(), d.requests()] {
            let mut prompts: Vec<Value> = leg.iter().map(|(_, b)| b["prompt"].clone()).collect();
            prompts.sort_by_key(|p| p.to_string());
            assert_eq!(prompts, [json!("a"), json!("b")], "{leg:?}");
            assert!(
                leg.iter().all(|(_, b)| b["bootstrap_room"].is_u64()),
                "{leg:?}"
            );
        }
    })
    .await;
}

#[tokio::test]
async fn numbers_reach_both_legs_byte_for_byte() {
    bounded(async {
        let (_link, p, d, gateway) = stack(Prefill::Normal, Decode::Normal).await;
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"temperature":1E-1,"seed":123456789012345678901234567890,"top_p":0.950000000000000000001}"#;
        let response = client()
            .post(gateway.at("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        for leg in [p.raw_bodies(), d.raw_bodies()] {
            let sent = String::from_utf8(leg[0].to_vec()).unwrap();
            for kept in [
                r#""temperature":1E-1"#,
                r#""seed":123456789012345678901234567890"#,
                r#""top_p":0.950000000000000000001"#,
            ] {
                assert!(sent.contains(kept), "{kept} not in {sent}");
            }
            assert!(sent.contains("bootstrap_room"), "{sent}");
        }
    })
    .await;
}

#[tokio::test]
async fn a_prefill_without_bootstrap_port_sends_null() {
    bounded(async {
        let link = Link::new();
        let p = SglangDouble::prefill(&link, Prefill::Normal).await;
        let d = SglangDouble::decode(&link, Decode::Normal).await;
        let mut config = config(&[&p], &[&d]);
        config.prefill_bootstrap_ports.clear();
        let gateway = Gateway::start(config).await;
        assert_eq!(
            post(&gateway, "/v1/chat/completions", &chat(true))
                .await
                .status(),
            200
        );
        assert_eq!(p.only_body()["bootstrap_port"], Value::Null);
    })
    .await;
}

#[tokio::test]
async fn prefill_failures_before_the_first_decode_byte_end_the_request_and_abort_decode() {
    bounded(async {
        let cases = [
            (Prefill::Status(400), 400, "double says 400"),
            (Prefill::Status(500), 502, "500"),
            (Prefill::Garbage, 502, "neither JSON nor an event stream"),
            (Prefill::Close, 502, "prefill worker"),
            (Prefill::Hang, 504, "did not answer"),
        ];
        for (behavior, status, text) in cases {
            for stream in [true, false] {
                let (_link, _p, d, gateway) = stack(behavior, Decode::Normal).await;
                let response = post(&gateway, "/v1/chat/completions", &chat(stream)).await;
                assert_eq!(response.status(), status, "{behavior:?} stream={stream}");
                let body = response.text().await.unwrap();
                assert!(body.contains(text), "{behavior:?}: {body}");
                // D was waiting for KV that never came: its connection is closed.
                d.wait_for_cancel().await;
            }
        }
    })
    .await;
}

/// The SSE body of a stream request that started (200) and ended.
async fn stream_body(gateway: &Gateway, path: &str, body: &Value) -> String {
    let response = post(gateway, path, body).await;
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

#[tokio::test]
async fn prefill_failures_after_the_first_decode_byte_end_the_stream_with_an_error() {
    bounded(async {
        for late in [
            Late::Status(500),
            Late::Status(400),
            Late::Garbage,
            Late::Close,
            Late::Hang,
        ] {
            for decode in [Decode::Endless, Decode::Normal] {
                let (_link, p, d, gateway) = stack(Prefill::AfterDecode(late), decode).await;
                let text = stream_body(&gateway, "/v1/chat/completions", &chat(true)).await;
                let events = sse_data(&text);
                assert!(events[0].contains("tok0"), "{late:?}: {text}");
                assert_eq!(events.last().unwrap(), "[DONE]", "{text}");
                assert_eq!(
                    events.iter().filter(|e| *e == "[DONE]").count(),
                    1,
                    "{text}"
                );
                let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
                let message = error["error"]["message"].as_str().unwrap();
                assert!(message.contains("prefill worker"), "{message}");
                if matches!(decode, Decode::Endless) {
                    d.wait_for_cancel().await;
                } else if matches!(late, Late::Hang) {
                    // D finished long before P timed out: its [DONE] waited for P.
                    assert!(text.contains("tok2"), "{text}");
                }
                if matches!(late, Late::Hang) {
                    p.wait_for_cancel().await;
                }
            }
        }
    })
    .await;
}

#[tokio::test]
async fn decode_failures_abort_the_prefill_leg() {
    bounded(async {
        let (_link, p, _d, gateway) = stack(Prefill::Hang, Decode::Status(500)).await;
        let response = post(&gateway, "/v1/chat/completions", &chat(true)).await;
        assert_eq!(response.status(), 502);
        p.wait_for_cancel().await;

        let (_link, p, _d, gateway) = stack(Prefill::Hang, Decode::Status(400)).await;
        let response = post(&gateway, "/v1/completions", &json!({"prompt": "a"})).await;
        assert_eq!(response.status(), 400, "a 4xx is passed through");
        p.wait_for_cancel().await;

        let (_link, p, _d, gateway) =
            stack(Prefill::AfterDecode(Late::Hang), Decode::FailMidStream).await;
        let text = stream_body(&gateway, "/v1/chat/completions", &chat(true)).await;
        let events = sse_data(&text);
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert!(events[events.len() - 2].contains("decode worker"), "{text}");
        p.wait_for_cancel().await;
    })
    .await;
}

#[tokio::test]
async fn a_client_that_goes_away_aborts_both_legs() {
    bounded(async {
        let (_link, p, d, gateway) = stack(Prefill::AfterDecode(Late::Hang), Decode::Endless).await;
        let response = post(&gateway, "/v1/chat/completions", &chat(true)).await;
        let mut body = response.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("tok0"));
        drop(body);
        d.wait_for_cancel().await;
        p.wait_for_cancel().await;
    })
    .await;
}

#[tokio::test]
async fn decode_streams_before_prefill_answers_unless_told_to_wait_for_its_head() {
    bounded(async {
        let (link, _p, _d, gateway) = stack(Prefill::Gated, Decode::Normal).await;
        let response = post(&gateway, "/v1/chat/completions", &chat(true)).await;
        let mut body = response.bytes_stream();
        // Fast path: D's first token reaches the client while P has not answered.
        let first = body.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("tok0"));
        link.release_prefill();
        let mut rest = Vec::new();
        while let Some(chunk) = body.next().await {
            rest.extend_from_slice(&chunk.unwrap());
        }
        assert!(String::from_utf8_lossy(&rest).ends_with("data: [DONE]\n\n"));

        let link = Link::new();
        let p = SglangDouble::prefill(&link, Prefill::Gated).await;
        let d = SglangDouble::decode(&link, Decode::Normal).await;
        let mut config = config(&[&p], &[&d]);
        config.sglang_wait_prefill_head = true;
        config.prefill_timeout = Duration::from_secs(20);
        let gateway = Gateway::start(config).await;
        let body = chat(true);
        let request = post(&gateway, "/v1/chat/completions", &body);
        tokio::pin!(request);
        // The client gets nothing while P's head has not come.
        let early = tokio::time::timeout(Duration::from_millis(500), &mut request).await;
        assert!(early.is_err(), "answered before the prefill head");
        link.release_prefill();
        let text = request.await.text().await.unwrap();
        assert!(
            text.contains("tok0") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_failed_prefill_is_retried_on_a_fresh_pair() {
    bounded(async {
        let link = Link::new();
        let p1 = SglangDouble::prefill(&link, Prefill::Status(500)).await;
        let p2 = SglangDouble::prefill(&link, Prefill::Normal).await;
        let d1 = SglangDouble::decode(&link, Decode::Normal).await;
        let d2 = SglangDouble::decode(&link, Decode::Normal).await;
        let mut config = config(&[&p1, &p2], &[&d1, &d2]);
        config.max_retries = 2;
        let gateway = Gateway::start(config).await;
        for stream in [true, false] {
            let response = post(&gateway, "/v1/chat/completions", &chat(stream)).await;
            assert_eq!(response.status(), 200);
            assert!(response.text().await.unwrap().contains("tok2"));
        }
        let p2_rooms: Vec<u64> = p2.requests().iter().flat_map(|(_, b)| rooms(b)).collect();
        assert_eq!(p2_rooms.len(), 2);
        // The retry drew a new room, and D got it from the pair that served it.
        let p1_rooms: Vec<u64> = p1.requests().iter().flat_map(|(_, b)| rooms(b)).collect();
        assert!(p1_rooms.iter().all(|r| !p2_rooms.contains(r)));
        let host_of = |(_, b): &(String, Value)| b["bootstrap_host"].clone();
        assert!(p2.requests().iter().map(host_of).all(|h| h == "127.0.0.1"));
    })
    .await;
}

#[tokio::test]
async fn input_logprobs_wait_for_prefill_and_are_merged() {
    bounded(async {
        let (_link, p, _d, gateway) = stack(Prefill::Normal, Decode::Normal).await;
        let body = json!({"text": "a b", "return_logprob": true});
        let answer: Value = post(&gateway, "/generate", &body)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            answer["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null], [-0.5, 2, null]])
        );
        let body = json!({"prompt": "a b", "echo": true, "logprobs": 1, "max_tokens": 1});
        let answer: Value = post(&gateway, "/v1/completions", &body)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            answer["choices"][0]["logprobs"]["token_logprobs"],
            json!([null, -0.5, -0.1])
        );
        // A stream: P answers in one body (stream=false, same room), D's events merged.
        let body = json!({"text": "a b", "return_logprob": true, "stream": true});
        let text = stream_body(&gateway, "/generate", &body).await;
        let first: Value = serde_json::from_str(&sse_data(&text)[0]).unwrap();
        assert_eq!(
            first["meta_info"]["input_token_logprobs"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let (_, p_body) = p.requests().pop().unwrap();
        assert_eq!(p_body["stream"], false);
        assert!(p_body["bootstrap_room"].is_u64());
    })
    .await;
}

#[tokio::test]
async fn generate_is_sglang_only() {
    bounded(async {
        let link = Link::new();
        let p = SglangDouble::prefill(&link, Prefill::Normal).await;
        let d = SglangDouble::decode(&link, Decode::Normal).await;
        let mut config = config(&[&p], &[&d]);
        config.protocol = Protocol::Vllm;
        let gateway = Gateway::start(config).await;
        let response = post(&gateway, "/generate", &json!({"text": "a"})).await;
        assert_eq!(response.status(), 404);
        assert!(p.requests().is_empty());
    })
    .await;
}

#[tokio::test]
async fn client_bootstrap_fields_never_reach_workers() {
    bounded(async {
        let smuggled = |mut body: Value| {
            body["bootstrap_host"] = json!("127.0.0.1");
            body["bootstrap_port"] = json!(1);
            body["bootstrap_room"] = json!(5);
            body["kv_transfer_params"] = json!({"remote_host": "127.0.0.1"});
            body
        };
        // vLLM mode: dropped from both legs.
        let p = crate::double::Double::start(crate::double::Role::Prefill, "p").await;
        let d = crate::double::Double::start(crate::double::Role::Decode, "d").await;
        let gateway = Gateway::start(crate::pd_config(&[&p], &[&d])).await;
        let response = post(&gateway, "/v1/chat/completions", &smuggled(chat(false))).await;
        assert_eq!(response.status(), 200);
        for body in [p.only_request().body, d.only_request().body] {
            for key in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
                assert!(body.get(key).is_none(), "{key} forwarded: {body}");
            }
        }
        // sglang mode: replaced by the gateway's own, on every route.
        for path in ["/v1/chat/completions", "/generate"] {
            let (_link, p, _d, gateway) = stack(Prefill::Normal, Decode::Normal).await;
            let body = smuggled(json!({"messages": [{"role": "user", "content": "hi"}],
                                       "text": "hi"}));
            assert_eq!(post(&gateway, path, &body).await.status(), 200, "{path}");
            let got = p.only_body();
            assert_eq!(got["bootstrap_port"], 8998);
            assert_ne!(got["bootstrap_room"], 5);
            assert!(got.get("kv_transfer_params").is_none(), "{got}");
        }
    })
    .await;
}

/// Reads `resp` until `marker` arrived (bounded).
async fn read_until(resp: &mut reqwest::Response, marker: &str) -> String {
    let mut got = String::new();
    while !got.contains(marker) {
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .unwrap_or_else(|_| panic!("{marker:?} did not come: {got}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the stream ended before {marker:?}: {got}"));
        got.push_str(&String::from_utf8_lossy(&chunk));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_streams_first_token_leads_before_the_decode_worker_answers() {
    bounded(async {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let (link, _p, _d, gw) = stack(
                Prefill::StreamsToken { then_break: false },
                Decode::GatedHead,
            )
            .await;
            let body = if path == "/v1/chat/completions" {
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": true, "max_tokens": 3, "temperature": 0})
            } else {
                json!({"model": "m", "prompt": "hi", "stream": true, "max_tokens": 3,
                       "temperature": 0})
            };
            let mut resp = post(&gw, path, &body).await;
            assert_eq!(resp.status(), 200);
            // The decode worker holds its head until released: the token came from P.
            let mut text = read_until(&mut resp, "tok0").await;
            link.release_prefill();
            while let Some(chunk) = resp.chunk().await.unwrap() {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            let events: Vec<Value> = sse_data(&text)
                .into_iter()
                .map(|d| serde_json::from_str(&d).unwrap_or(Value::String(d)))
                .collect();
            let tokens: Vec<&str> = events
                .iter()
                .filter_map(|e| {
                    e["choices"][0]["delta"]["content"]
                        .as_str()
                        .or(e["choices"][0]["text"].as_str())
                })
                .filter(|t| !t.is_empty())
                .collect();
            assert_eq!(tokens, ["tok0", "tok1", "tok2"], "{path}: {events:?}");
            let ids: Vec<&Value> = events.iter().filter_map(|e| e.get("id")).collect();
            assert!(ids.iter().all(|id| *id == "p"), "{path}: {events:?}");
            assert_eq!(events.last().unwrap(), "[DONE]", "{path}");
            let metrics = client().get(gw.at("/metrics")).send().await.unwrap();
            let metrics = metrics.text().await.unwrap();
            assert!(
                metrics.contains("pdserve_gateway_first_token_from_prefill_total 1"),
                "{metrics}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_dies_after_its_token_led_ends_the_stream_with_an_error() {
    bounded(async {
        let (link, _p, _d, gw) = stack(
            Prefill::StreamsToken { then_break: true },
            Decode::GatedHead,
        )
        .await;
        let mut body = chat(true);
        body["temperature"] = json!(0);
        let mut resp = post(&gw, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let mut text = read_until(&mut resp, "tok0").await;
        link.release_prefill();
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        let data = sse_data(&text);
        assert!(
            data.iter().any(|d| d.contains("\"error\"")),
            "cut silently: {text}"
        );
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    })
    .await;
}
