//! `/start_profile` and `/stop_profile` on a real worker (the default model over HTTP on
//! 127.0.0.1:0): with `--profile-dir` stop writes a Chrome trace of the scheduler's
//! steps; without it both routes answer 404, as vLLM does. Media items are refused.

mod support;

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use support::{serial, TestWorker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiling_writes_a_chrome_trace_and_media_items_are_refused() {
    serial(async {
        let dir = std::env::temp_dir().join(format!(
            "pdserve-worker-profile-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let w = TestWorker::start(&["--profile-dir", dir.to_str().unwrap()]).await;

        assert_eq!(w.post("/stop_profile", &json!({})).await.0, 400);
        let (status, body) = w.post("/start_profile", &json!({})).await;
        assert_eq!((status, body["status"].clone()), (200, json!("started")));
        let chat = json!({"messages": [{"role": "user", "content": "Count to three."}],
                          "max_tokens": 4, "ignore_eos": true});
        let (status, answer) = w.post("/v1/chat/completions", &chat).await;
        assert_eq!(status, 200, "{answer}");
        let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
        let (status, body) = w.post("/stop_profile", &json!({})).await;
        assert_eq!(status, 200, "{body}");

        let path = body["trace"].as_str().unwrap();
        assert!(path.starts_with(dir.to_str().unwrap()), "{path}");
        let trace: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let steps: Vec<&Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "step" && e["ph"] == "X")
            .collect();
        assert_eq!(steps.len() as u64, body["steps"].as_u64().unwrap());
        let sum = |key: &str| {
            steps
                .iter()
                .map(|s| s["args"][key].as_u64().unwrap())
                .sum::<u64>()
        };
        // The whole prompt was computed and each token after the first was one decode.
        assert_eq!(sum("prefill_tokens"), prompt_tokens);
        assert_eq!(sum("decode_tokens"), 3);
        assert!(steps.iter().all(|s| s["args"]["batch_size"] == 1));
        assert!(steps
            .iter()
            .all(|s| s["args"]["forward_us"].as_f64().unwrap() > 0.0));

        // The embedded model is text-only: a media item is a 400, never dropped.
        let image = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]});
        let (status, body) = w.post("/v1/chat/completions", &image).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "messages");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("text") && message.contains("image_url"),
            "{message}"
        );
        w.stop().await;
        std::fs::remove_dir_all(&dir).unwrap();

        let w = TestWorker::start(&[]).await;
        for route in ["/start_profile", "/stop_profile"] {
            let (status, body) = w.post(route, &json!({})).await;
            assert_eq!(status, 404, "{route}: {body}");
            assert!(body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--profile-dir"));
        }
        w.stop().await;
    })
    .await;
}
