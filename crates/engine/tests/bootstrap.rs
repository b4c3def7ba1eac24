//! SGLang's bootstrap protocol between real workers over HTTP on 127.0.0.1:0 (default
//! model): a prefill worker with `--bootstrap-port`, a decode worker, and an aggregated
//! worker as the oracle. The same body goes to P and D, in either order; every test ends
//! with no pinned KV blocks and no open rooms.

mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use support::bootstrap::{assert_clean, bootstrap_pair, with_room, ROOM_TIMEOUT_SECS};
use support::{completion, serial, TestWorker};

/// One forward thread and a small cache each: these tests run three workers at once on
/// 2 CI cores.
const SMALL: [&str; 4] = ["--threads", "1", "--num-kv-blocks", "96"];

/// An aggregated worker (the oracle) sized as the pair is.
async fn aggregated() -> TestWorker {
    TestWorker::start(&SMALL).await
}

/// A prefill worker with a bootstrap port, a decode worker, and the bootstrap port.
async fn pd() -> (TestWorker, TestWorker, u16) {
    bootstrap_pair(&SMALL).await
}

/// A greedy completion of 8 tokens.
fn short_completion(prompt: &str) -> Value {
    completion(prompt, json!({"max_tokens": 8}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_output_equals_aggregated_whichever_side_arrives_first() {
    serial(async {
        let agg = aggregated().await;
        let (p, d, port) = pd().await;
        let body = short_completion("The three primary colors are");
        let (status, want) = agg.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{want}");
        let want_text = want["choices"][0]["text"].as_str().unwrap().to_string();

        // Same body at once, D first, P first.
        for (room, d_delay, p_delay) in [(1u64, 0, 0), (2, 0, 400), (3, 400, 0)] {
            let body = with_room(&body, port, room);
            let (dr, pr) = tokio::join!(
                async {
                    tokio::time::sleep(Duration::from_millis(d_delay)).await;
                    d.post("/v1/completions", &body).await
                },
                async {
                    tokio::time::sleep(Duration::from_millis(p_delay)).await;
                    p.post("/v1/completions", &body).await
                },
            );
            assert_eq!(dr.0, 200, "room {room}: {} / P: {} {}", dr.1, pr.0, pr.1);
            assert_eq!(dr.1["choices"][0]["text"], want_text.as_str(), "room {room}");
            // The prefill answers one token, once its KV was read.
            assert_eq!(pr.0, 200, "room {room}: {}", pr.1);
            assert_eq!(pr.1["usage"]["completion_tokens"], 1, "room {room}");
            // SGLang's answers carry no vLLM handle (the KV was found by room).
            assert!(pr.1["kv_transfer_params"].is_null(), "{}", pr.1);
        }

        // Chat, streamed, and SGLang's /generate.
        let chat = json!({
            "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 8, "temperature": 0, "stream": true,
        });
        let want: String = agg
            .stream("/v1/chat/completions", &chat)
            .await
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(String::from))
            .collect();
        let body = with_room(&chat, port, 4);
        let (events, _) = tokio::join!(
            d.stream("/v1/chat/completions", &body),
            p.stream("/v1/chat/completions", &body)
        );
        let got: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(String::from))
            .collect();
        assert_eq!(got, want);
        assert_eq!(events.last().unwrap(), "[DONE]");

        let generate = json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}});
        let (_, want) = agg.post("/generate", &generate).await;
        let body = with_room(&generate, port, 5);
        let ((ds, dv), (ps, pv)) =
            tokio::join!(d.post("/generate", &body), p.post("/generate", &body));
        assert_eq!((ds, ps), (200, 200), "{dv} {pv}");
        assert_eq!(dv["text"], want["text"]);
        assert_eq!(pv["meta_info"]["completion_tokens"], 1);

        // A /generate batch: one room per input, as SGLang's router sends it.
        let batch = json!({
            "text": ["Once upon a time", "The sky is"],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "bootstrap_host": ["127.0.0.1", "127.0.0.1"],
            "bootstrap_port": [port, port],
            "bootstrap_room": [6, 7],
        });
        let (_, want) = agg
            .post(
                "/generate",
                &json!({"text": batch["text"], "sampling_params": batch["sampling_params"]}),
            )
            .await;
        let ((ds, dv), (ps, pv)) =
            tokio::join!(d.post("/generate", &batch), p.post("/generate", &batch));
        assert_eq!((ds, ps), (200, 200), "{dv} {pv}");
        assert_eq!(dv[0]["text"], want[0]["text"]);
        assert_eq!(dv[1]["text"], want[1]["text"]);

        assert_eq!(
            p.metric("pdserve_bootstrap_rooms_total{outcome=\"transferred\"}")
                .await,
            7.0
        );
        assert_eq!(
            d.metric("pdserve_bootstrap_rendezvous_total{outcome=\"ok\"}")
                .await,
            7.0
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
async fn a_side_that_never_comes_or_leaves_leaves_nothing_pinned() {
    serial(async {
        let (p, d, port) = pd().await;
        let body = short_completion("A short story about a robot:");

        // D never comes: P answers 500 after the room timeout and frees the KV.
        let started = Instant::now();
        let (status, err) = p.post("/v1/completions", &with_room(&body, port, 10)).await;
        assert_eq!(status, 500, "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains("no decode worker claimed"), "{message}");
        assert!(started.elapsed() < Duration::from_secs(ROOM_TIMEOUT_SECS + 20));
        assert_clean(&p).await;
        assert_eq!(
            p.metric("pdserve_bootstrap_rooms_total{outcome=\"unclaimed\"}")
                .await,
            1.0
        );

        // P never comes: D answers an error in bounded time; the room read leaves nothing.
        let started = Instant::now();
        let (status, err) = d.post("/v1/completions", &with_room(&body, port, 11)).await;
        assert!(status == 502 || status == 504, "{status} {err}");
        assert!(started.elapsed() < Duration::from_secs(ROOM_TIMEOUT_SECS + 20));
        assert_clean(&p).await;
        assert_clean(&d).await;

        // No bootstrap port at all on the D side: 502 at once, nothing open.
        let (status, _) = d.post("/v1/completions", &with_room(&body, 1, 12)).await;
        assert_eq!(status, 502);

        // P's client leaves before D came: the room closes and its KV is freed.
        let quick = reqwest::Client::builder()
            .timeout(Duration::from_millis(1500))
            .build()
            .unwrap();
        let gone = quick
            .post(format!("{}/v1/completions", p.base))
            .json(&with_room(&body, port, 13))
            .send()
            .await;
        assert!(gone.is_err(), "the prefill answered before any decode came");
        assert_clean(&p).await;

        // D's client leaves mid-stream: both sides end clean.
        let streamed = with_room(
            &json!({"prompt": "Count: one, two,", "max_tokens": 64, "temperature": 0,
                    "ignore_eos": true, "stream": true}),
            port,
            14,
        );
        let prefill = p.post("/v1/completions", &streamed);
        let decode = async {
            let resp = d
                .http
                .post(format!("{}/v1/completions", d.base))
                .json(&streamed)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let mut chunks = resp.bytes_stream();
            chunks.next().await.expect("a first chunk").unwrap();
            // Dropped here: the client disconnects.
        };
        let ((status, _), ()) = tokio::join!(prefill, decode);
        assert_eq!(status, 200);
        assert_clean(&p).await;
        assert_clean(&d).await;

        // A room is one prefill's: a second prefill of a room in use is refused.
        let room = with_room(&body, port, 15);
        let (first, second) = tokio::join!(p.post("/v1/completions", &room), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            p.post("/v1/completions", &room).await
        });
        assert_eq!(second.0, 400, "{}", second.1);
        assert_eq!(first.0, 500);
        assert_clean(&p).await;
        p.stop().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_info_routes_and_generate_shapes() {
    serial(async {
        let w = aggregated().await;
        for path in ["/server_info", "/get_server_info"] {
            let (status, info) = w.get(path).await;
            assert_eq!(status, 200);
            assert_eq!(info["disaggregation_mode"], "null");
            assert!(info["bootstrap_port"].is_null());
            assert!(info["model_path"].as_str().unwrap().ends_with(".gguf"), "{info}");
            assert_eq!(info["tokenizer_path"], info["model_path"]);
            assert_eq!(info["dp_size"], 1);
        }
        for path in ["/model_info", "/get_model_info"] {
            let (status, info) = w.get(path).await;
            assert_eq!(status, 200);
            assert_eq!(info["is_generation"], true);
            assert!(info["model_path"].is_string() && info["tokenizer_path"].is_string());
        }
        // SGLang's gateway probes gRPC health first; a 404 makes it use HTTP.
        let (status, _) = w.post("/grpc.health.v1.Health/Check", &json!({})).await;
        assert_eq!(status, 404);

        let sp = json!({"max_new_tokens": 6, "temperature": 0, "ignore_eos": true});
        let (status, one) = w
            .post("/generate", &json!({"text": "Hello, my name is", "sampling_params": sp, "rid": "r1"}))
            .await;
        assert_eq!(status, 200, "{one}");
        let meta = &one["meta_info"];
        assert_eq!(meta["id"], "r1");
        assert_eq!(meta["completion_tokens"], 6);
        assert_eq!(meta["finish_reason"], json!({"type": "length", "length": 6}));
        assert!(meta["prompt_tokens"].as_u64().unwrap() > 0);
        assert!(meta["cached_tokens"].is_u64() && meta["e2e_latency"].is_f64());

        // A batch answers a list, in input order; token ids work as text does.
        let (status, batch) = w
            .post(
                "/generate",
                &json!({"text": ["Hello, my name is", "The sky is"], "sampling_params": sp}),
            )
            .await;
        assert_eq!(status, 200, "{batch}");
        assert_eq!(batch.as_array().unwrap().len(), 2);
        assert_eq!(batch[0]["text"], one["text"]);
        let (_, ids) = w
            .post(
                "/v1/completions",
                &json!({"prompt": "Hello, my name is", "max_tokens": 1}),
            )
            .await;
        let prompt_tokens = ids["usage"]["prompt_tokens"].as_u64().unwrap();
        let (status, by_ids) = w
            .post(
                "/generate",
                &json!({"input_ids": [[1, 2, 3, 4]], "sampling_params": sp, "return_logprob": true}),
            )
            .await;
        assert_eq!(status, 200, "{by_ids}");
        let lps = by_ids[0]["meta_info"]["output_token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), 6);
        assert!(lps[0][0].is_f64() && lps[0][1].is_u64());
        assert!(prompt_tokens > 0);

        // Streaming: cumulative text, finish_reason on the last event, then [DONE].
        let events = w
            .stream(
                "/generate",
                &json!({"text": "Hello, my name is", "sampling_params": sp, "stream": true}),
            )
            .await;
        assert_eq!(events.last().unwrap(), "[DONE]");
        let data = &events[..events.len() - 1];
        let last = data.last().unwrap();
        assert_eq!(last["text"], one["text"]);
        assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
        for pair in data.windows(2) {
            let (a, b) = (pair[0]["text"].as_str().unwrap(), pair[1]["text"].as_str().unwrap());
            assert!(b.starts_with(a), "text is cumulative: {a:?} then {b:?}");
            assert!(pair[0]["meta_info"]["finish_reason"].is_null());
        }
        let events = w
            .stream(
                "/generate",
                &json!({"text": ["a", "b"], "sampling_params": sp, "stream": true}),
            )
            .await;
        let ends: Vec<_> = events
            .iter()
            .filter(|e| !e["meta_info"]["finish_reason"].is_null())
            .map(|e| e["index"].as_u64().unwrap())
            .collect();
        assert_eq!(ends.len(), 2);
        assert!(ends.contains(&0) && ends.contains(&1));

        // Validation errors: 400 in the OpenAI error shape.
        for bad in [
            json!({"text": "x", "input_ids": [1]}),
            json!({}),
            json!({"text": "x", "sampling_params": {"no_such_param": 1}}),
            json!({"text": "x", "sampling_params": {"temperature": -1}}),
            json!({"text": ["a", "b"], "rid": ["only-one"]}),
            // Fields that would change the answer are refused, not ignored.
            json!({"text": "x", "lora_path": "adapter"}),
            json!({"text": "x", "image_data": "aGk="}),
        ] {
            let (status, err) = w.post("/generate", &bad).await;
            assert_eq!(status, 400, "{bad} -> {err}");
            assert!(err["error"]["message"].is_string(), "{err}");
        }
        // Null values and logging-only fields are accepted.
        let (status, err) = w
            .post(
                "/generate",
                &json!({"text": "x", "sampling_params": sp, "lora_path": null, "log_metrics": true}),
            )
            .await;
        assert_eq!(status, 200, "{err}");
        // An aggregated worker ignores the bootstrap fields, as SGLang's does.
        let (status, _) = w
            .post("/generate", &with_room(&json!({"text": "x", "sampling_params": sp}), 1, 9))
            .await;
        assert_eq!(status, 200);
        assert_clean(&w).await;
        w.stop().await;
    })
    .await;
}
