//! A decode worker's conversation hand-back is evictable cache, not pinned KV (issue 14):
//! it holds no pin, the pool reclaims it when it needs the space, and a next turn that
//! names reclaimed blocks still succeeds (the prefill worker hears "gone" and computes
//! the prompt) with the same greedy output. Real workers on 127.0.0.1:0.

mod support;

use serde_json::json;
use support::kv::{decode_leg, prefill_leg, PINNED};
use support::{serial, text_of, TestWorker, TEST_DEADLINE};

const PROMPT: &str = "Here is a short story about a lighthouse keeper who";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaimed_handback_is_recomputed_with_the_same_output() {
    serial(async {
        let prefill = TestWorker::start(&["--role", "prefill"]).await;
        // 32 blocks of 16 tokens: one long request needs all of them.
        let decode = TestWorker::start(&["--role", "decode", "--num-kv-blocks", "32"]).await;

        // Turn 1 by hand, as vLLM's proxy drives it.
        let p1 = prefill
            .ok("/v1/completions", &prefill_leg(PROMPT, json!({})))
            .await;
        let d1 = decode
            .ok(
                "/v1/completions",
                &decode_leg(PROMPT, 8, &p1["kv_transfer_params"]),
            )
            .await;
        let hand_back = d1["kv_transfer_params"].clone();
        assert!(hand_back["remote_request_id"].is_string(), "{d1}");
        // Kept for the next turn without a pin.
        decode.wait_metric(PINNED, 0.0).await;
        decode.wait_metric("pdserve_kv_blocks_pinned", 0.0).await;

        // A request that needs the whole pool reclaims the hand-back's blocks.
        let filler: Vec<u32> = (100..600).collect();
        let fill = json!({"model": "smollm2", "prompt": filler, "max_tokens": 1});
        decode.ok("/v1/completions", &fill).await;
        // Counted once the step that reclaimed them ends (just after the answer).
        let started = std::time::Instant::now();
        while decode
            .metric("pdserve_kv_handback_reclaimed_blocks_total")
            .await
            < 1.0
        {
            assert!(started.elapsed() < TEST_DEADLINE, "nothing reclaimed");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }

        // Turn 2 names the reclaimed hand-back: the prefill worker is told "gone",
        // computes the prompt itself, and the request succeeds.
        let prompt2 = format!("{PROMPT}{} Then one night,", text_of(&d1));
        let p2 = prefill
            .ok("/v1/completions", &prefill_leg(&prompt2, hand_back))
            .await;
        assert_eq!(
            prefill.metric("pdserve_kv_handback_gone_total").await,
            1.0,
            "{p2}"
        );
        assert_eq!(
            prefill
                .metric("pdserve_kv_transfer_imported_tokens_total")
                .await,
            0.0,
            "nothing was imported"
        );
        let d2 = decode
            .ok(
                "/v1/completions",
                &decode_leg(&prompt2, 12, &p2["kv_transfer_params"]),
            )
            .await;

        // The same turn without any hand-back gives the same greedy text.
        let p_ref = prefill
            .ok("/v1/completions", &prefill_leg(&prompt2, json!({})))
            .await;
        let d_ref = decode
            .ok(
                "/v1/completions",
                &decode_leg(&prompt2, 12, &p_ref["kv_transfer_params"]),
            )
            .await;
        assert_eq!(text_of(&d2), text_of(&d_ref));
        prefill.wait_metric(PINNED, 0.0).await;
        prefill.stop().await;
        decode.stop().await;
    })
    .await;
}
