//! Who a worker exchanges KV with (issue 14): `--kv-peers` on the reading side (a
//! `remote_host` outside it is refused without a connection), the shared transfer secret
//! (`--kv-secret` / `PDSERVE_KV_SECRET`), and `POST /v1/kv/release`. Real workers with the
//! default model on 127.0.0.1:0, one test at a time.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::kv::{decode_leg, prefill_leg, PINNED};
use support::{serial, text_of, TestWorker};
use tokio::net::TcpListener;

const PROMPT: &str = "The quick brown fox jumps over the lazy dog, and then the dog";
const RELEASE: &str = "/v1/kv/release";
const SECRET_HEADER: &str = "X-PDServe-KV-Secret";

/// A decode leg naming 127.0.0.1:`port` on a worker whose `--kv-peers` is `::1` only.
fn handle_at(port: u16) -> Value {
    json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "engine-x", "remote_request_id": "pdkv-x",
        "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": port,
    })
}

/// A worker given `kv_transfer_params` pointing at a host outside `--kv-peers` answers
/// 400 without connecting, and the same answer whether the port listens or is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_host_outside_kv_peers_is_refused_without_connecting() {
    serial(async {
        let decode = TestWorker::start(&["--role", "decode", "--kv-peers", "::1"]).await;
        let listening = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open_port = listening.local_addr().unwrap().port();
        let closed_port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut answers = Vec::new();
        for port in [open_port, closed_port] {
            let body = decode_leg(PROMPT, 4, &handle_at(port));
            let (status, answer) = decode.post("/v1/completions", &body).await;
            assert_eq!(status, 400, "{answer}");
            answers.push(answer);
        }
        let message = answers[0]["error"]["message"].as_str().unwrap();
        assert!(message.contains("not an allowed KV peer"), "{message}");
        assert_eq!(
            answers[0], answers[1],
            "the answer reveals nothing of the port"
        );
        assert_eq!(answers[0]["error"]["param"], "kv_transfer_params");
        // Nothing was dialled.
        let accepted = tokio::time::timeout(Duration::from_millis(300), listening.accept()).await;
        assert!(accepted.is_err(), "the worker connected to a refused peer");
        assert_eq!(
            decode
                .metric("pdserve_kv_transfer_peers_refused_total")
                .await,
            2.0
        );
        // Chat requests go the same way.
        let chat = json!({"model": "smollm2", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": handle_at(open_port)});
        let (status, _) = decode.post("/v1/chat/completions", &chat).await;
        assert_eq!(status, 400);
        decode.stop().await;
    })
    .await;
}

/// A decode worker with another transfer secret is refused by the prefill worker (the
/// blocks stay published), one with the right secret reads them, and no pin is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_need_the_prefill_workers_secret() {
    serial(async {
        let prefill = TestWorker::start(&["--role", "prefill", "--kv-secret", "right"]).await;
        let wrong = TestWorker::start(&["--role", "decode", "--kv-secret", "wrong"]).await;
        let right = TestWorker::start(&["--role", "decode", "--kv-secret", "right"]).await;
        let p = prefill
            .ok("/v1/completions", &prefill_leg(PROMPT, json!({})))
            .await;
        let params = p["kv_transfer_params"].clone();
        let pinned = prefill.metric(PINNED).await;
        assert!(pinned > 0.0, "{p}");

        let (status, answer) = wrong
            .post("/v1/completions", &decode_leg(PROMPT, 4, &params))
            .await;
        assert_eq!(status, 502, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("secret"), "{message}");
        assert_eq!(prefill.metric(PINNED).await, pinned, "still published");

        let d = right
            .ok("/v1/completions", &decode_leg(PROMPT, 4, &params))
            .await;
        assert!(!text_of(&d).is_empty());
        prefill.wait_metric(PINNED, 0.0).await;
        prefill.wait_metric("pdserve_kv_blocks_pinned", 0.0).await;
        for w in [prefill, wrong, right] {
            w.stop().await;
        }
    })
    .await;
}

/// `POST /v1/kv/release` frees a prefill's published blocks at once, needs the secret,
/// and releasing again is a no-op.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_a_prefill_handle_at_once_and_repeats_are_no_ops() {
    serial(async {
        let prefill = TestWorker::start(&["--role", "prefill", "--kv-secret", "s3cret"]).await;
        let p = prefill
            .ok("/v1/completions", &prefill_leg(PROMPT, json!({})))
            .await;
        let params = p["kv_transfer_params"].clone();
        let blocks = params["remote_block_ids"][0].as_array().unwrap().len();
        assert_eq!(prefill.metric(PINNED).await, blocks as f64);
        let body = json!({"kv_transfer_params": params});

        for headers in [vec![], vec![(SECRET_HEADER, "nope")]] {
            let (status, answer) = prefill.post_with(RELEASE, &body, &headers).await;
            assert_eq!(status, 401, "{answer}");
            assert_eq!(answer["error"]["code"], "invalid_kv_secret");
        }
        assert_eq!(prefill.metric(PINNED).await, blocks as f64);

        let auth = [(SECRET_HEADER, "s3cret")];
        let (status, answer) = prefill.post_with(RELEASE, &body, &auth).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["released"], true);
        assert_eq!(answer["blocks"], blocks);
        // Freed before the answer: no waiting.
        assert_eq!(prefill.metric(PINNED).await, 0.0);
        assert_eq!(prefill.metric("pdserve_kv_blocks_pinned").await, 0.0);

        let (status, answer) = prefill.post_with(RELEASE, &body, &auth).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["released"], false);
        assert_eq!(
            prefill.metric("pdserve_kv_transfer_released_total").await,
            1.0
        );

        let (status, answer) = prefill
            .post_with(RELEASE, &json!({"kv_transfer_params": {}}), &auth)
            .await;
        assert_eq!(status, 400, "{answer}");
        let mut other = body.clone();
        other["kv_transfer_params"]["remote_engine_id"] = json!("another-engine");
        let (status, _) = prefill.post_with(RELEASE, &other, &auth).await;
        assert_eq!(status, 400);

        // A released handle cannot be read any more.
        let decode = TestWorker::start(&["--role", "decode", "--kv-secret", "s3cret"]).await;
        let (status, _) = decode
            .post(
                "/v1/completions",
                &decode_leg(PROMPT, 4, &body["kv_transfer_params"]),
            )
            .await;
        assert_eq!(status, 502);
        decode.stop().await;
        prefill.stop().await;
    })
    .await;
}
