//! Serving to an SLO through `pdserve up --policy slo` (P/D, the real engine): the
//! objectives' headers are checked, and the latency predictor learns every worker's part
//! from the requests that went through (routed by `precise_prefix` while it is untrained)
//! and publishes its error.

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
