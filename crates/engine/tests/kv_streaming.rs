//! KV that moves while a chunked prefill runs (`--max-num-batched-tokens` far below the
//! prompt), between real workers on 127.0.0.1:0 with the default model: SGLang's
//! bootstrap rooms and the decode-as-orchestrator's concurrent handoff, whose reads
//! start before the prefill ends and get each block as its chunk is computed. The
//! decode output equals an aggregated worker's token for token, the blocks went out
//! while the prefill computed, the gap metrics are recorded, and nothing stays pinned.

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::bootstrap::{assert_clean, bootstrap_pair, with_room};
use support::{completion, serial, text_of, TestWorker};

/// Chunks of 32 tokens (the prompts below take several), one forward thread and a small
/// cache each: three workers at once on 2 CI cores.
const CHUNKED: [&str; 6] = [
    "--max-num-batched-tokens",
    "32",
    "--threads",
    "1",
    "--num-kv-blocks",
    "96",
];

/// A prompt of some 200 tokens: seven chunks or so.
fn long_prompt(topic: &str) -> String {
    let mut prompt = format!("Here are some notes about {topic}. ");
    for i in 1..=12 {
        prompt.push_str(&format!(
            "Note {i}: the {topic} was seen again on day {i}. "
        ));
    }
    prompt.push_str("In one sentence, the notes say that");
    prompt
}

/// Waits until `w`'s histogram `name` has counted at least `at_least` observations.
async fn counted(w: &TestWorker, name: &str, at_least: f64) -> f64 {
    let start = Instant::now();
    loop {
        let got = w.metric(&format!("{name}_count")).await;
        if got >= at_least {
            return got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name} counted {got}, want at least {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_rooms_stream_a_chunked_prefill_and_decode_equals_aggregated() {
    serial(async {
        let agg = TestWorker::start(&CHUNKED).await;
        let (p, d, port) = bootstrap_pair(&CHUNKED).await;
        for (room, topic, d_delay) in [
            (21u64, "lighthouse", 0),
            (22, "orchard", 0),
            (23, "comet", 150),
        ] {
            let body = completion(&long_prompt(topic), json!({"max_tokens": 8}));
            let want = text_of(&agg.ok("/v1/completions", &body).await);
            let body = with_room(&body, port, room);
            // The decode worker's read waits at the bootstrap port while P prefills.
            let (dr, pr) = tokio::join!(
                async {
                    tokio::time::sleep(Duration::from_millis(d_delay)).await;
                    d.post("/v1/completions", &body).await
                },
                p.post("/v1/completions", &body),
            );
            assert_eq!(dr.0, 200, "room {room}: {} / P: {} {}", dr.1, pr.0, pr.1);
            assert_eq!(pr.0, 200, "room {room}: {}", pr.1);
            assert!(
                pr.1["usage"]["prompt_tokens"].as_u64().unwrap() > 150,
                "{}",
                pr.1
            );
            assert_eq!(text_of(&dr.1), want, "room {room}");
        }
        // Streamed too (chat), and SGLang's /generate.
        let chat = json!({
            "messages": [{"role": "user", "content": long_prompt("harbour")}],
            "max_tokens": 8, "temperature": 0, "stream": true,
        });
        let content = |events: &[Value]| -> String {
            events
                .iter()
                .filter_map(|e| {
                    e["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(String::from)
                })
                .collect()
        };
        let want = content(&agg.stream("/v1/chat/completions", &chat).await);
        let body = with_room(&chat, port, 24);
        let (events, _) = tokio::join!(
            d.stream("/v1/chat/completions", &body),
            p.stream("/v1/chat/completions", &body)
        );
        assert_eq!(content(&events), want);
        let generate = json!({"text": long_prompt("glacier"),
                              "sampling_params": {"max_new_tokens": 8, "temperature": 0}});
        let (_, want) = agg.post("/generate", &generate).await;
        let body = with_room(&generate, port, 25);
        let ((ds, dv), (ps, pv)) =
            tokio::join!(d.post("/generate", &body), p.post("/generate", &body));
        assert_eq!((ds, ps), (200, 200), "{dv} {pv}");
        assert_eq!(dv["text"], want["text"]);

        // Blocks left P while it still computed; both sides timed the handoff's gap.
        let streamed = p.metric("pdserve_kv_transfer_blocks_streamed_total").await;
        assert!(streamed > 0.0, "no block was sent before its prefill ended");
        counted(&p, "pdserve_kv_stream_tail_seconds", 5.0).await;
        counted(&d, "pdserve_kv_import_wait_seconds", 5.0).await;
        assert_eq!(
            p.metric("pdserve_kv_transfer_serve_failures_total").await,
            0.0
        );
        for w in [&p, &d, &agg] {
            assert_clean(w).await;
        }
        p.stop().await;
        d.stop().await;
        agg.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_concurrent_orchestrator_streams_a_chunked_prefill_and_equals_aggregated() {
    serial(async {
        let agg = TestWorker::start(&CHUNKED).await;
        let p = TestWorker::start(&[&["--role", "prefill"][..], &CHUNKED].concat()).await;
        let orchestrator = [
            &[
                "--role",
                "decode",
                "--prefill",
                p.base.as_str(),
                "--handoff",
                "concurrent",
            ][..],
            &CHUNKED,
        ]
        .concat();
        let d = TestWorker::start(&orchestrator).await;
        // Healthy once a prefill -> decode pair is pre-warmed.
        let start = Instant::now();
        while d.get("/health").await.0 != 200 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "never pre-warmed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let before = p.metric("pdserve_kv_stream_tail_seconds_count").await;
        for topic in ["lighthouse", "orchard", "comet"] {
            let body = completion(&long_prompt(topic), json!({"max_tokens": 8}));
            let want = text_of(&agg.ok("/v1/completions", &body).await);
            assert_eq!(
                text_of(&d.ok("/v1/completions", &body).await),
                want,
                "{topic}"
            );
        }
        let chat = json!({
            "messages": [{"role": "user", "content": long_prompt("harbour")}],
            "max_tokens": 8, "temperature": 0, "stream": true,
        });
        let content = |events: &[Value]| -> String {
            events
                .iter()
                .filter_map(|e| {
                    e["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(String::from)
                })
                .collect()
        };
        let want = content(&agg.stream("/v1/chat/completions", &chat).await);
        assert_eq!(
            content(&d.stream("/v1/chat/completions", &chat).await),
            want
        );

        let streamed = p.metric("pdserve_kv_transfer_blocks_streamed_total").await;
        assert!(streamed > 0.0, "no block was sent before its prefill ended");
        counted(&p, "pdserve_kv_stream_tail_seconds", before + 4.0).await;
        counted(&d, "pdserve_kv_import_wait_seconds", 4.0).await;
        let fallbacks = d
            .metric("pdserve_orchestrator_concurrent_fallbacks_total")
            .await;
        assert_eq!(fallbacks, 0.0, "every concurrent read got its blocks early");
        for w in [&p, &d, &agg] {
            assert_clean(w).await;
        }
        d.stop().await;
        p.stop().await;
        agg.stop().await;
    })
    .await;
}
