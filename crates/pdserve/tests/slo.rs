//! Serving to an SLO through `pdserve up --policy slo`.
//! - The real engine (P/D): the objectives' headers are checked, and the latency
//!   predictor learns every worker's part from the requests that went through (routed by
//!   `precise_prefix` while it is untrained) and publishes its error.
//! - A simulated 2P+2D fleet, trained: the routing notes carry each choice's prediction,
//!   and a sheddable request that no worker is predicted to serve in time is a 429 with
//!   `Retry-After`, while the same request at priority 0 is served; `/planner` answers.

use std::time::Duration;

use serde_json::{json, Value};

#[path = "support/up.rs"]
mod up;

use up::Up;

async fn metrics(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the sample that starts with `series`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_are_checked_and_the_predictor_learns_each_role() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let up = Up::start(
        &model,
        &["--gateway-arg=--slo-ttft-ms", "--gateway-arg=2000"],
    );
    tokio::time::timeout(Duration::from_secs(300), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let chat = |text: String| {
            json!({"messages": [{"role": "user", "content": text}], "max_tokens": 8,
                   "temperature": 0, "stream": true})
        };
        // A malformed objective is a 400 that names its header.
        for (header, value) in [("x-slo-ttft-ms", "soon"), ("x-slo-tpot-ms", "0")] {
            let response = http
                .post(format!("{}/v1/chat/completions", up.entry))
                .header(header, value)
                .json(&chat("hi".into()))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 400, "{header}: {value}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(error["error"]["param"], header, "{error}");
        }
        // Streamed requests one at a time: the prefill worker is idle for each, so each
        // goes through it (up's --disagg-min-prefill-load 1).
        for i in 0..8 {
            let words = 20 + 20 * (i % 3);
            let text: String = (0..words).map(|w| format!("w{i}x{w} ")).collect();
            let response = http
                .post(format!("{}/v1/chat/completions", up.entry))
                .header("x-slo-tpot-ms", "100")
                .json(&chat(text))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            let body = response.text().await.unwrap();
            assert!(body.contains("[DONE]"), "{body}");
        }
        let text = metrics(&http, &up.entry).await;
        for (role, target) in [("prefill", "ttft"), ("decode", "ttft"), ("decode", "tpot")] {
            let series = format!(
                r#"pdserve_gateway_predictor_error_ratio{{role="{role}",target="{target}"}}"#
            );
            let error = sample(&text, &series)
                .unwrap_or_else(|| panic!("no {series} after 8 requests:\n{text}"));
            assert!(error.is_finite() && error >= 0.0, "{series} {error}");
            eprintln!("{series} {error:.3} after 8 requests (untrained: the prior's error)");
        }
    })
    .await
    .expect("the test ran past its time limit");
    up.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trained_fleet_shows_its_predictions_and_sheds_only_sheddable_requests() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let up = Up::start(
        &model,
        &[
            "--sim",
            "h100-llama-3.1-8b",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--policy",
            "slo",
            "--gateway-arg=--expose-routing",
        ],
    );
    tokio::time::timeout(Duration::from_secs(300), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let prompt = |i: usize, words: usize| -> String {
            (0..words).map(|w| format!("t{i}w{w} ")).collect()
        };
        let completion = |text: String| {
            json!({"prompt": text, "max_tokens": 6, "temperature": 0, "stream": true})
        };
        // Train: past the predictor's 50 samples per model, four at a time.
        let mut served = 0;
        for round in 0..40 {
            let mut sends = tokio::task::JoinSet::new();
            for k in 0..4 {
                let i = round * 4 + k;
                let send = http
                    .post(format!("{}/v1/completions", up.entry))
                    .json(&completion(prompt(i, 60 + 90 * (i % 5))))
                    .send();
                sends.spawn(async move {
                    let response = send.await.unwrap();
                    assert_eq!(response.status(), 200);
                    assert!(response.text().await.unwrap().contains("[DONE]"));
                });
            }
            while let Some(sent) = sends.join_next().await {
                sent.unwrap();
                served += 1;
            }
        }
        assert_eq!(served, 160);
        // Trained: each choice's prediction is in the routing notes.
        let response = http
            .post(format!("{}/v1/completions", up.entry))
            .header("x-slo-ttft-ms", "5000")
            .json(&completion(prompt(1000, 400)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let headers = response.headers().clone();
        let _ = response.text().await;
        let predicted: Vec<String> = ["x-pdserve-prefill-predicted", "x-pdserve-decode-predicted", "x-pdserve-worker-predicted"]
            .iter()
            .filter_map(|h| headers.get(*h).map(|v| format!("{h}: {}", v.to_str().unwrap())))
            .collect();
        assert!(!predicted.is_empty(), "no prediction in the routing notes: {headers:?}");
        assert!(predicted.iter().all(|p| p.contains("ttft_ms=")), "{predicted:?}");
        eprintln!("{predicted:?}");

        // An objective no worker can meet: sheddable requests are refused, priority 0 is served.
        let hopeless = |priority: &str| {
            http.post(format!("{}/v1/completions", up.entry))
                .header("x-slo-ttft-ms", "0.01")
                .header("x-pdserve-priority", priority)
                .json(&completion(prompt(2000, 300)))
                .send()
        };
        let shed = hopeless("1").await.unwrap();
        assert_eq!(shed.status(), 429);
        let retry_after: u64 = shed
            .headers()
            .get("retry-after")
            .expect("a shed request is told when to retry")
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry_after), "Retry-After {retry_after}");
        let error: Value = shed.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("predicted") && message.contains("--shed-priority"), "{error}");
        let kept = hopeless("0").await.unwrap();
        assert_eq!(kept.status(), 200, "priority 0 is never shed on a prediction");
        assert!(kept.text().await.unwrap().contains("[DONE]"));
        let text = metrics(&http, &up.entry).await;
        let sheds = sample(&text, r#"pdserve_gateway_rejected_requests_total{reason="slo_shed"}"#);
        assert_eq!(sheds, Some(1.0), "{text}");
        for (role, target) in [("prefill", "ttft"), ("decode", "ttft"), ("decode", "tpot")] {
            let series = format!(
                r#"pdserve_gateway_predictor_error_ratio{{role="{role}",target="{target}"}}"#
            );
            eprintln!("{series} {:?} after 160 requests", sample(&text, &series));
        }

        // The planner answers with a count for each pool, and says why; within its next
        // decision (every 5 s) it has counted the requests with objectives above.
        let mut plan = Value::Null;
        for _ in 0..30 {
            plan = http
                .get(format!("{}/planner", up.entry))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if plan["attainment"]["ttft"].is_number() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        eprintln!("/planner: {plan}");
        for role in ["prefill", "decode"] {
            let n = plan[role].as_u64().unwrap_or_else(|| panic!("no {role} in {plan}"));
            assert!(n >= 1, "{plan}");
            assert_eq!(plan["current"][role], 2, "{plan}");
            let gauge = sample(
                &text,
                &format!(r#"pdserve_planner_desired_workers{{role="{role}"}}"#),
            );
            assert!(gauge.is_some_and(|g| g >= 1.0), "{role}: {gauge:?}");
        }
        assert!(plan["reason"].as_str().is_some_and(|r| !r.is_empty()), "{plan}");
        assert!(plan["attainment"]["ttft"].is_number(), "the window's TTFT attainment: {plan}");
    })
    .await
    .expect("the test ran past its time limit");
    up.stop();
}
