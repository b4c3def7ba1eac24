//! The live status page: `/dashboard` is one self-contained page (nothing loaded from
//! elsewhere), and `/dashboard/data` shows a row per worker, the requests with the route
//! each took, and per-second samples once traffic passed.

use std::time::Duration;

use futures::StreamExt;
use pdserve_gateway::config::Protocol;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::sglang_double::{self, Link, SglangDouble};
use crate::{bounded, client, pd_config, urls, Gateway};

/// Every `src`/`href` value of `html`, and any `url(...)` in its style.
fn referenced_urls(html: &str) -> Vec<String> {
    let mut found = Vec::new();
    for attr in ["src=", "href=", "url("] {
        for (at, _) in html.match_indices(attr) {
            let rest = html[at + attr.len()..].trim_start_matches(['"', '\'']);
            let end = rest.find(['"', '\'', ')', ' ', '>']).unwrap_or(rest.len());
            found.push(rest[..end].to_string());
        }
    }
    found
}

#[tokio::test]
async fn the_page_is_self_contained() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        // Open under --api-key, like /metrics and /instances.
        let mut config = pd_config(&[&p], &[&d]);
        config.api_key = Some("secret".into());
        let gw = Gateway::start(config).await;
        let data = client().get(gw.at("/dashboard/data")).send().await.unwrap();
        assert_eq!(data.status(), 200);
        let response = client().get(gw.at("/dashboard")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let content_type = response.headers()["content-type"].to_str().unwrap();
        assert!(content_type.starts_with("text/html"), "{content_type}");
        let html = response.text().await.unwrap();
        assert!(html.contains("<svg") && html.contains("\"/data\""));
        for url in referenced_urls(&html) {
            assert!(
                !(url.starts_with("http:") || url.starts_with("https:") || url.starts_with("//")),
                "the page loads {url} from elsewhere"
            );
        }
        for external in ["http://", "https://", "//cdn", "@import"] {
            assert!(!html.contains(external), "the page names {external}");
        }
    })
    .await;
}

#[tokio::test]
async fn data_shows_the_roster_the_routes_and_per_second_samples() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.expose_routing = true;
        let gw = Gateway::start(config).await;
        let http = client();
        for stream in [false, true, true] {
            let body = json!({
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 4,
                "stream": stream,
            });
            let response = http
                .post(gw.at("/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
        // Samples are closed when their second ends: wait for one that counts requests.
        let mut data = Value::Null;
        for _ in 0..40 {
            data = http
                .get(gw.at("/dashboard/data"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let counted: u64 = data["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["requests"].as_u64().unwrap())
                .sum();
            if counted == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let samples = data["samples"].as_array().unwrap();
        let busy: Vec<&Value> = samples
            .iter()
            .filter(|s| s["requests"].as_u64() > Some(0))
            .collect();
        assert!(!busy.is_empty(), "no sample counted the requests: {data}");
        assert!(
            busy.iter()
                .all(|s| s["errors"] == 0 && s["e2e_ms"]["p50"].as_f64() > Some(0.0)),
            "{data}"
        );
        let chart = |key: &str| samples.iter().any(|s| s[key]["p99"].as_f64() > Some(0.0));
        for key in ["ttft_ms", "prefill_ms", "decode_ttfb_ms", "e2e_ms"] {
            assert!(chart(key), "no {key} sample: {data}");
        }

        let mut rows: Vec<(String, String)> = data["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                assert_eq!(w["health"], "live");
                assert_eq!(w["source"], "static");
                assert_eq!(w["circuit"], "closed");
                (
                    w["url"].as_str().unwrap().into(),
                    w["role"].as_str().unwrap().into(),
                )
            })
            .collect();
        rows.sort();
        let mut expected = vec![
            (p.url.clone(), "prefill".into()),
            (d.url.clone(), "decode".into()),
        ];
        expected.sort();
        assert_eq!(rows, expected);

        let requests = data["requests"].as_array().unwrap();
        assert_eq!(requests.len(), 3, "{data}");
        for (request, stream) in requests.iter().zip([true, true, false]) {
            assert_eq!(request["endpoint"], "/v1/chat/completions");
            assert_eq!(request["mode"], "vllm_pd");
            assert_eq!(request["prefill"]["url"], p.url.as_str());
            assert_eq!(request["decode"]["url"], d.url.as_str());
            assert!(request["worker"].is_null());
            assert_eq!(request["status"], 200);
            assert_eq!(request["outcome"], "ok");
            assert_eq!(request["stream"], stream);
            assert!(request["duration_ms"].as_f64() > Some(0.0));
            assert_eq!(request["ttft_ms"].is_number(), stream, "{request}");
            assert!(!request["request_id"].as_str().unwrap().is_empty());
        }
        // A refused request is listed too, routed nowhere.
        let response = http
            .post(gw.at("/v1/chat/completions"))
            .json(&json!({"messages": "not a list"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        let data: Value = http
            .get(gw.at("/dashboard/data"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let newest = &data["requests"][0];
        assert_eq!(newest["status"], 400);
        assert_eq!(newest["outcome"], "error");
        assert_eq!(newest["mode"], "unrouted");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_failed_and_abandoned_requests_are_listed_as_such() {
    bounded(async {
        let w = Double::start(Role::Decode, "W").await;
        let gw = Gateway::start(GatewayConfig::new(Vec::new(), Vec::new(), urls(&[&w]))).await;
        let http = client();
        let send = |stream: bool| {
            http.post(gw.at("/v1/chat/completions")).json(&json!({
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": stream,
            }))
        };
        assert_eq!(send(false).send().await.unwrap().status(), 200);
        w.set(Behavior::FailMidStream);
        let failed = send(true).send().await.unwrap();
        assert_eq!(failed.status(), 200);
        failed.bytes().await.unwrap();
        w.set(Behavior::Hold);
        let held = send(true).send().await.unwrap();
        let mut body = held.bytes_stream();
        body.next().await.unwrap().unwrap();
        drop(body);
        w.wait_for_cancel().await;

        let mut requests = Vec::new();
        for _ in 0..100 {
            let data: Value = http
                .get(gw.at("/dashboard/data"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            requests = data["requests"].as_array().unwrap().clone();
            if requests.len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(requests.len(), 3, "{requests:?}");
        let row = |r: &Value| {
            (
                r["mode"].as_str().unwrap().to_string(),
                r["worker"]["url"].as_str().unwrap().to_string(),
                r["status"].as_u64().unwrap(),
                r["outcome"].as_str().unwrap().to_string(),
            )
        };
        let aggregated = |status, outcome: &str| {
            (
                "aggregated".to_string(),
                w.url.clone(),
                status,
                outcome.to_string(),
            )
        };
        assert_eq!(row(&requests[0]), aggregated(499, "client_left"));
        assert_eq!(row(&requests[1]), aggregated(502, "stream_error"));
        assert_eq!(row(&requests[2]), aggregated(200, "ok"));
        assert!(requests[0]["itl_ms"].is_null() && requests[1]["itl_ms"].is_null());
    })
    .await;
}

/// Sends `body` to `gw`'s chat route and reads the whole answer; the newest row of
/// `/dashboard/data` once the request is filed.
async fn filed_row(gw: &Gateway, body: Value) -> Value {
    let before = listed(gw).await.len();
    let response = client()
        .post(gw.at("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    for _ in 0..200 {
        let rows = listed(gw).await;
        if rows.len() > before {
            return rows[0].clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the request was never filed");
}

/// The request rows of `gw`'s `/dashboard/data`, newest first.
async fn listed(gw: &Gateway) -> Vec<Value> {
    let data: Value = client()
        .get(gw.at("/dashboard/data"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    data["requests"].as_array().unwrap().clone()
}

/// A chat of `max_tokens` 3, streamed or not, with `extra` fields.
fn chat(content: &str, stream: bool, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": stream,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// A row's mode, workers and stream flag, and whether it has TTFT and ITL figures.
fn shape(row: &Value) -> (String, Value, Value, Value, Value, bool, bool) {
    (
        row["mode"].as_str().unwrap().to_string(),
        row["prefill"]["url"].clone(),
        row["decode"]["url"].clone(),
        row["worker"]["url"].clone(),
        row["stream"].clone(),
        row["ttft_ms"].as_f64().is_some_and(|t| t > 0.0),
        row["itl_ms"].as_f64().is_some_and(|t| t >= 0.0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_mode_files_its_row_as_the_request_went() {
    bounded(async {
        // vLLM's P/D with the gateway's defaults: a stream is led by the prefill's token.
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[&p], &[&d]);
        config.disagg_threshold = Some(64);
        config.disagg_min_prefill_load = 0;
        let gw = Gateway::start(config).await;
        let long = "word ".repeat(200);
        let (pu, du) = (json!(p.url), json!(d.url));
        let pd = |stream, figures| {
            let f = stream && figures;
            (
                "vllm_pd".to_string(),
                pu.clone(),
                du.clone(),
                Value::Null,
                json!(stream),
                f,
                f,
            )
        };
        let row = filed_row(&gw, chat(&long, true, json!({}))).await;
        assert_eq!(
            shape(&row),
            pd(true, true),
            "led by the prefill's token: {row}"
        );
        assert_eq!(
            (row["status"].clone(), row["outcome"].clone()),
            (json!(200), json!("ok"))
        );
        let row = filed_row(
            &gw,
            chat(&long, true, json!({"first_token_from_prefill": false})),
        )
        .await;
        assert_eq!(
            shape(&row),
            pd(true, true),
            "the decode's own stream: {row}"
        );
        let row = filed_row(&gw, chat(&long, false, json!({}))).await;
        assert_eq!(shape(&row), pd(false, false), "{row}");
        // A short uncached prompt skips the prefill leg.
        let row = filed_row(&gw, chat("hi", true, json!({}))).await;
        let skipped = (
            "prefill_skipped".to_string(),
            Value::Null,
            du.clone(),
            Value::Null,
        );
        let got = shape(&row);
        assert_eq!((got.0, got.1, got.2, got.3), skipped, "{row}");
        assert_eq!((got.4, got.5, got.6), (json!(true), true, true), "{row}");

        // Aggregated.
        let w = Double::start(Role::Decode, "W").await;
        let gw = Gateway::start(GatewayConfig::new(Vec::new(), Vec::new(), urls(&[&w]))).await;
        let row = filed_row(&gw, chat("hi", true, json!({}))).await;
        let wu = json!(w.url);
        assert_eq!(
            shape(&row),
            (
                "aggregated".to_string(),
                Value::Null,
                Value::Null,
                wu,
                json!(true),
                true,
                true
            ),
            "{row}"
        );

        // Encoders in front of P/D and of an aggregated worker.
        let encoder = crate::encoder::Encoder::start("e0").await;
        let (ep, ed, ew) = (
            Double::start(Role::Prefill, "EP").await,
            Double::start(Role::Decode, "ED").await,
            Double::start(Role::Decode, "EW").await,
        );
        let media = [crate::epd::image("a")];
        let gw = crate::epd::epd_gateway(&[&encoder], &[&ep], &[&ed], &[], |_| {}).await;
        for stream in [true, false] {
            let mut body = crate::epd::mm_request(&media, stream);
            body["temperature"] = json!(0);
            let row = filed_row(&gw, body).await;
            let want = (
                "e_p_d".to_string(),
                json!(ep.url),
                json!(ed.url),
                Value::Null,
                json!(stream),
                stream,
                stream,
            );
            assert_eq!(shape(&row), want, "{row}");
        }
        let gw = crate::epd::epd_gateway(&[&encoder], &[], &[], &[&ew], |_| {}).await;
        let row = filed_row(&gw, crate::epd::mm_request(&media, true)).await;
        let want = (
            "e_pd".to_string(),
            Value::Null,
            Value::Null,
            json!(ew.url),
            json!(true),
            true,
            true,
        );
        assert_eq!(shape(&row), want, "{row}");

        // SGLang's bootstrap handoff.
        let link = Link::new();
        let sp = SglangDouble::prefill(&link, sglang_double::Prefill::Normal).await;
        let sd = SglangDouble::decode(&link, sglang_double::Decode::Normal).await;
        let parse =
            |url: &str| pdserve_gateway::fleet::registry::parse_worker_url("t", url).unwrap();
        let mut config = GatewayConfig::new(vec![parse(&sp.url)], vec![parse(&sd.url)], Vec::new());
        config.protocol = Protocol::Sglang;
        config.prefill_bootstrap_ports = vec![Some(8998)];
        let gw = Gateway::start(config).await;
        let (spu, sdu) = (json!(sp.url), json!(sd.url));
        for stream in [true, false] {
            let row = filed_row(&gw, chat(&long, stream, json!({}))).await;
            assert_eq!(
                shape(&row),
                (
                    "sglang_pd".to_string(),
                    spu.clone(),
                    sdu.clone(),
                    Value::Null,
                    json!(stream),
                    stream,
                    stream
                ),
                "{row}"
            );
        }
    })
    .await;
}
