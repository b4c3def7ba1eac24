//! The worker's status page on a real worker (the default model over HTTP on
//! 127.0.0.1:0): `/dashboard` loads nothing from elsewhere, and `/dashboard/data` shows
//! the role, model and KV blocks, the requests served, and token rates once two samples
//! a second apart saw traffic between them.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{chat, completion, serial, TestWorker};

async fn data(worker: &TestWorker) -> Value {
    worker
        .http
        .get(format!("{}/dashboard/data", worker.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_worker_dashboard_shows_its_state_and_requests() {
    serial(async {
        let worker = TestWorker::start(&["--role", "prefill_decode"]).await;
        let page = worker
            .http
            .get(format!("{}/dashboard", worker.base))
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 200);
        let html = page.text().await.unwrap();
        assert!(html.contains("<svg") && html.contains("\"/data\""));
        for external in ["http://", "https://", "//cdn", "@import"] {
            assert!(!html.contains(external), "the page names {external}");
        }

        let first = data(&worker).await;
        assert_eq!(first["worker"]["role"], "prefill_decode");
        assert_eq!(first["worker"]["model"], "smollm2");
        assert_eq!(first["requests"].as_array().unwrap().len(), 0);

        let (status, _) = worker
            .post(
                "/v1/completions",
                &completion("The capital of France is", json!({"max_tokens": 4})),
            )
            .await;
        assert_eq!(status, 200);
        let streamed = worker
            .http
            .post(format!("{}/v1/chat/completions", worker.base))
            .header("x-request-id", "dashboard-stream")
            .json(&chat("Say hi.", json!({"max_tokens": 4, "stream": true})))
            .send()
            .await
            .unwrap();
        assert_eq!(streamed.status(), 200);
        streamed.bytes().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;

        let after = data(&worker).await;
        let requests = after["requests"].as_array().unwrap();
        assert_eq!(requests.len(), 2, "{after}");
        let newest = &requests[0];
        assert_eq!(newest["request_id"], "dashboard-stream");
        assert_eq!(newest["path"], "/v1/chat/completions");
        assert_eq!(newest["stream"], true);
        assert_eq!(newest["status"], 200);
        assert_eq!(newest["outcome"], "ok");
        assert!(newest["duration_ms"].as_f64() >= newest["head_ms"].as_f64());
        assert_eq!(requests[1]["path"], "/v1/completions");
        assert_eq!(requests[1]["stream"], false);

        // Samples are taken at polls and finished requests, a second apart at least.
        let samples = after["samples"].as_array().unwrap();
        assert!(samples.len() >= 2, "{after}");
        let rate = |key: &str| samples.iter().any(|s| s[key].as_f64() > Some(0.0));
        assert!(rate("prompt_tokens_per_s"), "{after}");
        assert!(rate("generation_tokens_per_s"), "{after}");
        assert!(after["worker"]["generation_tokens_total"].as_u64() >= Some(8));
        // The scheduler publishes its block counts after a step.
        assert!(
            after["worker"]["kv_blocks_free"].as_i64() > Some(0),
            "{after}"
        );
        worker.stop().await;
    })
    .await;
}
