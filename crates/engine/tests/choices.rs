//! Parallel sampling (`n`) on the OpenAI routes of a real worker (default model, HTTP on
//! 127.0.0.1:0): greedy choices equal the single answer, indexes and usage are OpenAI's,
//! seeded choices repeat, choices after the first reuse its prompt blocks, bad `n` is a
//! 400; and on an SGLang prefill/decode pair each choice meets its own room, with nothing
//! left pinned or open when one of them fails.

mod support;

use serde_json::{json, Value};
use support::bootstrap::{assert_clean, bootstrap_pair};
use support::{chat, completion, serial, TestWorker};

const ROUTES: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

fn body(route: &str, content: &str, extra: Value) -> Value {
    match route {
        "/v1/chat/completions" => chat(content, extra),
        _ => completion(content, extra),
    }
}

/// A choice's text in a non-streamed answer.
fn text(choice: &Value) -> String {
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {choice}"))
        .to_string()
}

fn texts(answer: &Value) -> Vec<String> {
    let choices = answer["choices"].as_array().unwrap();
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{answer}");
    }
    choices.iter().map(text).collect()
}

/// What a stream of `n` choices said, folded per choice.
#[derive(Debug, Default)]
struct Folded {
    texts: Vec<String>,
    finishes: Vec<Vec<String>>,
    roles: Vec<usize>,
    usage: Vec<Value>,
    /// Whether the usage chunk came after every finish chunk.
    usage_last: bool,
}

async fn stream(w: &TestWorker, route: &str, body: &Value, n: usize) -> Folded {
    let resp = w
        .http
        .post(format!("{}{route}", w.base))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let raw = resp.text().await.unwrap();
    assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
    let mut folded = Folded {
        texts: vec![String::new(); n],
        finishes: vec![Vec::new(); n],
        roles: vec![0; n],
        ..Default::default()
    };
    for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        if !chunk["usage"].is_null() {
            folded.usage.push(chunk["usage"].clone());
            folded.usage_last = folded.finishes.iter().all(|f| f.len() == 1);
        }
        for choice in chunk["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            assert!(i < n, "{chunk}");
            let t = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str());
            folded.texts[i].push_str(t.unwrap_or(""));
            if choice["delta"]["role"] == "assistant" {
                folded.roles[i] += 1;
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                folded.finishes[i].push(reason.to_string());
            }
        }
    }
    folded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_choices_equal_the_single_answer_streamed_or_not() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        for route in ROUTES {
            let one = body(route, "Name a fruit.", json!({"max_tokens": 8}));
            let (status, single) = w.post(route, &one).await;
            assert_eq!(status, 200, "{single}");
            let want = texts(&single);
            assert_eq!(want.len(), 1);
            let single_completion = single["usage"]["completion_tokens"].as_u64().unwrap();
            let prompt_tokens = single["usage"]["prompt_tokens"].as_u64().unwrap();

            let three = body(route, "Name a fruit.", json!({"max_tokens": 8, "n": 3}));
            let (status, answer) = w.post(route, &three).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(texts(&answer), vec![want[0].clone(); 3], "{route}");
            for choice in answer["choices"].as_array().unwrap() {
                assert_eq!(
                    choice["finish_reason"],
                    single["choices"][0]["finish_reason"]
                );
            }
            // The prompt counted once, completions summed.
            let usage = &answer["usage"];
            assert_eq!(usage["prompt_tokens"], prompt_tokens, "{usage}");
            assert_eq!(usage["completion_tokens"], 3 * single_completion, "{usage}");
            assert_eq!(usage["total_tokens"], prompt_tokens + 3 * single_completion);

            let mut streamed = three.clone();
            streamed["stream"] = json!(true);
            streamed["stream_options"] = json!({"include_usage": true});
            let folded = stream(&w, route, &streamed, 3).await;
            assert_eq!(folded.texts, vec![want[0].clone(); 3], "{route}");
            for finishes in &folded.finishes {
                assert_eq!(finishes.len(), 1, "one finish chunk per choice: {folded:?}");
            }
            if route == "/v1/chat/completions" {
                assert_eq!(folded.roles, [1, 1, 1], "a role chunk per choice");
            }
            assert_eq!(folded.usage.len(), 1, "usage once: {folded:?}");
            assert!(
                folded.usage_last,
                "usage after every choice ended: {folded:?}"
            );
            assert_eq!(folded.usage[0]["completion_tokens"], 3 * single_completion);
            assert_eq!(folded.usage[0]["prompt_tokens"], prompt_tokens);
        }
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_choices_reuse_the_first_choices_prompt_blocks() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        // A prompt this worker has never seen, of several full 16-token blocks.
        let prompt = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi \
                      omicron pi rho sigma tau upsilon phi chi psi omega, and then";
        let before = w.metric("pdserve_prefix_cache_hits_total").await;
        let (status, answer) = w
            .post(
                "/v1/completions",
                &completion(prompt, json!({"max_tokens": 2, "n": 3})),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 32, "{answer}");
        let hits = w.metric("pdserve_prefix_cache_hits_total").await - before;
        // Choices 1 and 2 each find every full block but the one holding the last token
        // (in the prefix cache once choice 0 has computed the prompt).
        let cached = (prompt_tokens - 1) / 16 * 16;
        assert_eq!(hits, (2 * cached) as f64, "{answer}");
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_choices_repeat_and_differ_with_logprobs_per_choice() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let sampled = |n: usize, seed: u64| {
            chat(
                "Tell me a story.",
                json!({"max_tokens": 12, "temperature": 1.0, "seed": seed, "n": n,
                       "logprobs": true, "top_logprobs": 2}),
            )
        };
        let (status, first) = w.post("/v1/chat/completions", &sampled(3, 7)).await;
        assert_eq!(status, 200, "{first}");
        let (_, second) = w.post("/v1/chat/completions", &sampled(3, 7)).await;
        let choices = texts(&first);
        assert_eq!(choices, texts(&second), "the same seed, the same choices");
        assert!(
            choices[0] != choices[1] || choices[1] != choices[2],
            "sampled choices all alike: {choices:?}"
        );
        // Choice i samples with seed + i: it is the single answer seeded so.
        for (i, want) in choices.iter().enumerate() {
            let (_, single) = w
                .post("/v1/chat/completions", &sampled(1, 7 + i as u64))
                .await;
            assert_eq!(&texts(&single)[0], want, "choice {i}");
        }
        let total: usize = first["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let content = c["logprobs"]["content"].as_array().unwrap();
                assert!(content
                    .iter()
                    .all(|t| t["top_logprobs"].as_array().unwrap().len() == 2));
                content.len()
            })
            .sum();
        assert_eq!(first["usage"]["completion_tokens"], total, "{first}");

        // Completions: each choice's text_offset starts at its own text.
        let body = completion(
            "Once upon a time",
            json!({"max_tokens": 6, "n": 2, "logprobs": 1}),
        );
        let (_, answer) = w.post("/v1/completions", &body).await;
        for choice in answer["choices"].as_array().unwrap() {
            assert_eq!(choice["logprobs"]["text_offset"][0], 0, "{answer}");
            let tokens: String = choice["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect();
            assert_eq!(tokens, text(choice));
        }
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_out_of_range_is_a_400_naming_n() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        for route in ROUTES {
            for n in [json!(0), json!(-1), json!(129)] {
                let (status, err) = w.post(route, &body(route, "hi", json!({"n": n}))).await;
                assert_eq!(status, 400, "{route} n={n}: {err}");
                assert_eq!(err["error"]["param"], "n", "{err}");
            }
            let (status, answer) = w
                .post(
                    route,
                    &body(route, "hi", json!({"n": 128, "max_tokens": 1})),
                )
                .await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["choices"].as_array().unwrap().len(), 128);
        }
        // A worker without a KV transfer service serves a remote-decode prefill in
        // full, as for one choice: every choice its own.
        let handoff = completion(
            "hi",
            json!({"n": 2, "max_tokens": 3, "ignore_eos": true, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        let (status, answer) = w.post("/v1/completions", &handoff).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], 6, "{answer}");
        // SGLang's /generate: n out of range, or not the same for every input.
        for sp in [
            json!({"n": 0}),
            json!({"n": 129}),
            json!([{"n": 2}, {"n": 3}]),
            json!([{"n": 2}, {}]),
        ] {
            let generate = json!({"text": ["hi", "ho"], "sampling_params": sp});
            let (status, err) = w.post("/generate", &generate).await;
            assert_eq!(
                (status, &err["error"]["param"]),
                (400, &json!("n")),
                "{sp}: {err}"
            );
        }
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}

/// A worker orchestrating with `--prefill` sends an `n` = 2 request's prompt to its
/// prefill worker once (one publication), imports it once (whole, as choice 0 starts
/// from the prefill's first token) into choice 0 and decodes
/// both choices, each equal to the aggregated one; with either handoff mode, streamed
/// and not. With the prefill worker unreachable, `n` = 2 fails as `n` = 1 does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_orchestrator_prefills_several_choices_once() {
    serial(async {
        let route = "/v1/completions";
        let prompt = "The lighthouse keeper climbed the stairs every evening to light the \
                      lamp, and one night he saw";
        let two = completion(prompt, json!({"max_tokens": 6, "n": 2}));
        let agg = TestWorker::start(&[]).await;
        let (status, want) = agg.post(route, &two).await;
        assert_eq!(status, 200, "{want}");
        let prompt_tokens = want["usage"]["prompt_tokens"].as_f64().unwrap();
        let want = texts(&want);
        agg.stop().await;

        let p = TestWorker::start(&["--role", "prefill", "--kv-abort-timeout", "300"]).await;
        for handoff in ["sequential", "concurrent"] {
            let d = TestWorker::start(&[
                "--role",
                "decode",
                "--prefill",
                &p.base,
                "--handoff",
                handoff,
            ])
            .await;
            // Warm (its pre-warm request has gone through P) before counting.
            let started = std::time::Instant::now();
            while d
                .http
                .get(format!("{}/health", d.base))
                .send()
                .await
                .unwrap()
                .status()
                != 200
            {
                assert!(started.elapsed().as_secs() < 60, "{handoff}: never warm");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            for stream in [false, true] {
                let published = p.metric("pdserve_kv_transfer_published_total").await;
                let imported = d.metric("pdserve_kv_transfer_imported_tokens_total").await;
                let mut body = two.clone();
                body["stream"] = json!(stream);
                let got = if stream {
                    stream_texts(&d, route, &body, 2).await
                } else {
                    let (status, answer) = d.post(route, &body).await;
                    assert_eq!(status, 200, "{answer}");
                    texts(&answer)
                };
                assert_eq!(got, want, "{handoff} stream={stream}");
                let now = p.metric("pdserve_kv_transfer_published_total").await;
                assert_eq!(now - published, 1.0, "{handoff}: one prefill per request");
                let now = d.metric("pdserve_kv_transfer_imported_tokens_total").await;
                // The whole prompt: choice 0 starts from the prefill's first token.
                assert_eq!(now - imported, prompt_tokens, "{handoff}: imported once");
            }
            assert_clean(&d).await;
            d.stop().await;
        }
        assert_clean(&p).await;
        assert_eq!(
            p.metric("pdserve_kv_transfer_aborted_by_timeout_total")
                .await,
            0.0
        );
        p.stop().await;

        // Its only prefill worker is a closed port: no choice count is served here.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let prefill = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let w = TestWorker::start(&[
            "--role",
            "decode",
            "--prefill",
            &prefill,
            "--prefill-timeout-secs",
            "2",
        ])
        .await;
        for n in [1, 2] {
            let mut body = completion("Once upon a time", json!({"max_tokens": 6}));
            body["n"] = json!(n);
            let (status, err) = w.post(route, &body).await;
            assert!(status >= 500, "n={n}: {status} {err}");
        }
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_choice_meets_its_own_room_and_a_failed_choice_leaves_nothing() {
    serial(async {
        let (p, d, port) = bootstrap_pair(&[]).await;
        let agg = TestWorker::start(&[]).await;
        let plain = chat("Name a color.", json!({"max_tokens": 6, "n": 2}));
        let (status, want) = agg.post("/v1/chat/completions", &plain).await;
        assert_eq!(status, 200, "{want}");
        let want = texts(&want);
        agg.stop().await;

        let with_rooms = |room: Value, stream: bool| {
            let mut body = plain.clone();
            body["bootstrap_host"] = json!("127.0.0.1");
            body["bootstrap_port"] = json!(port);
            body["bootstrap_room"] = room;
            body["stream"] = json!(stream);
            body
        };
        // One room per choice (SGLang's router for n > 1), or one room for both (read as
        // room + i on both sides).
        for (room, stream) in [
            (json!([101, 202]), false),
            (json!([303, 404]), true),
            (json!(500), false),
            (json!(600), true),
        ] {
            let body = with_rooms(room, stream);
            let route = "/v1/chat/completions";
            let (prefilled, got) = tokio::join!(p.post(route, &body), async {
                if stream {
                    stream_texts(&d, route, &body, 2).await
                } else {
                    let (status, answer) = d.post(route, &body).await;
                    assert_eq!(status, 200, "{answer}");
                    texts(&answer)
                }
            });
            assert_eq!(prefilled.0, 200, "{}", prefilled.1);
            assert_eq!(
                got, want,
                "rooms {} stream {stream}",
                body["bootstrap_room"]
            );
        }
        assert_clean(&p).await;
        assert_clean(&d).await;

        // Choice 1's room on D (702) is one P never fills, and P's (701) one D never
        // claims: both answer an error once their wait ends, and choice 0, whose room met,
        // is dropped on both sides with everything it held.
        let (to_p, to_d) = (
            with_rooms(json!([700, 701]), false),
            with_rooms(json!([700, 702]), false),
        );
        let (prefilled, decoded) = tokio::join!(
            p.post("/v1/chat/completions", &to_p),
            d.post("/v1/chat/completions", &to_d),
        );
        // D's own wait for the room (504) and P's wait for a prefill in room 702, which
        // answers D's read with a refusal (502), run out at about the same time: either
        // ends D's choice, and each names why.
        let d_timed_out = decoded.0 == 504;
        let p_refused = decoded.0 == 502 && decoded.1.to_string().contains("bootstrap_room 702");
        assert!(d_timed_out || p_refused, "{decoded:?}");
        assert!(prefilled.0 >= 500, "{prefilled:?}");
        assert_clean(&p).await;
        assert_clean(&d).await;
        p.stop().await;
        d.stop().await;
    })
    .await;
}

async fn stream_texts(w: &TestWorker, route: &str, body: &Value, n: usize) -> Vec<String> {
    let folded = stream(w, route, body, n).await;
    assert!(folded.finishes.iter().all(|f| f.len() == 1), "{folded:?}");
    folded.texts
}

/// A streamed answer's chunks, parsed (none may be an error).
async fn stream_chunks(w: &TestWorker, route: &str, body: &Value) -> Vec<Value> {
    let resp = w
        .http
        .post(format!("{}{route}", w.base))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let raw = resp.text().await.unwrap();
    assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
    let chunks: Vec<Value> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "{raw}");
    chunks
}

/// vLLM's handoff by hand with `n` = 2 on both legs (what the gateway sends): P
/// prefills once and publishes one handle, answering two choices that carry it; D
/// imports it once and decodes both choices, each equal to the aggregated one. P's
/// export is read (not expired) and nothing stays pinned on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_remote_decode_prefill_publishes_once_and_the_decode_imports_once() {
    serial(async {
        let agg = TestWorker::start(&[]).await;
        let route = "/v1/completions";
        let prompt = "The lighthouse keeper climbed the stairs every evening to light the \
                      lamp, and one night he saw";
        let plain = completion(prompt, json!({"max_tokens": 6, "n": 2}));
        let (status, want) = agg.post(route, &plain).await;
        assert_eq!(status, 200, "{want}");
        let prompt_tokens = want["usage"]["prompt_tokens"].as_f64().unwrap();
        let want = texts(&want);
        agg.stop().await;

        // A long abort timeout: an export left unread cannot expire and pass as freed.
        let p = TestWorker::start(&["--role", "prefill", "--kv-abort-timeout", "300"]).await;
        let d = TestWorker::start(&["--role", "decode"]).await;
        let mut prefill = plain.clone();
        prefill["max_tokens"] = json!(1);
        prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
        for (round, p_streams) in [false, true].into_iter().enumerate() {
            let params = if p_streams {
                prefill["stream"] = json!(true);
                let chunks = stream_chunks(&p, route, &prefill).await;
                let finishes: Vec<&Value> = chunks
                    .iter()
                    .filter(|c| c["choices"][0]["finish_reason"].is_string())
                    .collect();
                let indexes: Vec<_> = finishes.iter().map(|c| &c["choices"][0]["index"]).collect();
                assert_eq!(indexes, [&json!(0), &json!(1)], "{chunks:?}");
                // Both finish chunks carry the one handle.
                assert_eq!(
                    finishes[0]["kv_transfer_params"],
                    finishes[1]["kv_transfer_params"]
                );
                finishes[0]["kv_transfer_params"].clone()
            } else {
                let (status, answer) = p.post(route, &prefill).await;
                assert_eq!(status, 200, "{answer}");
                assert_eq!(texts(&answer).len(), 2, "{answer}");
                // One sequence ran: its one token, the prompt once.
                assert_eq!(answer["usage"]["completion_tokens"], 1, "{answer}");
                answer["kv_transfer_params"].clone()
            };
            assert_eq!(params["do_remote_prefill"], true, "{params}");
            let published = p.metric("pdserve_kv_transfer_published_total").await;
            assert_eq!(published, round as f64 + 1.0, "one handle per prefill");

            let imported = d.metric("pdserve_kv_transfer_imported_tokens_total").await;
            let mut decode = plain.clone();
            decode["kv_transfer_params"] = params;
            let got = if p_streams {
                let (status, answer) = d.post(route, &decode).await;
                assert_eq!(status, 200, "{answer}");
                texts(&answer)
            } else {
                decode["stream"] = json!(true);
                stream_texts(&d, route, &decode, 2).await
            };
            assert_eq!(got, want, "round {round}");
            let now = d.metric("pdserve_kv_transfer_imported_tokens_total").await;
            assert_eq!(now - imported, prompt_tokens - 1.0, "imported once");
            assert_clean(&p).await;
            assert_clean(&d).await;
        }
        assert_eq!(
            p.metric("pdserve_kv_transfer_aborted_by_timeout_total")
                .await,
            0.0
        );
        p.stop().await;
        d.stop().await;
    })
    .await;
}

/// The texts of a `/generate` list answer, and its `meta_info.id`s.
fn generate_texts(answer: &Value) -> (Vec<String>, Vec<String>) {
    let list = answer
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {answer}"));
    let field = |k: &str| -> Vec<String> {
        list.iter()
            .map(|o| match k {
                "text" => o["text"].as_str().unwrap().to_string(),
                _ => o["meta_info"]["id"].as_str().unwrap().to_string(),
            })
            .collect()
    };
    (field("text"), field("id"))
}

/// SGLang's `/generate` with `sampling_params.n` = 2: one input answers a list of two
/// outputs, a batch of two answers four listed input by input (input 0's samples, then
/// input 1's), streamed events carry that `index`; greedy samples equal the `n` = 1
/// output and every output has its own `rid`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_lists_n_samples_per_input_in_sglang_order() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let prompts = ["Once upon a time", "The capital of France is"];
        let sp = json!({"max_new_tokens": 6, "temperature": 0});
        let mut single = Vec::new();
        for prompt in prompts {
            let (status, answer) = w
                .post("/generate", &json!({"text": prompt, "sampling_params": sp}))
                .await;
            assert_eq!(status, 200, "{answer}");
            single.push(answer["text"].as_str().unwrap().to_string());
        }
        let mut sp2 = sp.clone();
        sp2["n"] = json!(2);

        let (status, answer) = w
            .post(
                "/generate",
                &json!({"text": prompts[0], "sampling_params": sp2}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        let (texts, ids) = generate_texts(&answer);
        assert_eq!(texts, vec![single[0].clone(); 2]);
        assert_ne!(ids[0], ids[1], "each sample has its own rid");

        let batch = json!({"text": prompts, "sampling_params": [sp2, sp2]});
        let (status, answer) = w.post("/generate", &batch).await;
        assert_eq!(status, 200, "{answer}");
        let want = vec![
            single[0].clone(),
            single[0].clone(),
            single[1].clone(),
            single[1].clone(),
        ];
        assert_eq!(generate_texts(&answer).0, want);

        let mut streamed = batch.clone();
        streamed["stream"] = json!(true);
        let resp = w
            .http
            .post(format!("{}/generate", w.base))
            .json(&streamed)
            .send()
            .await
            .unwrap();
        let raw = resp.text().await.unwrap();
        assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
        let mut last = vec![String::new(); 4];
        for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                break;
            }
            let event: Value = serde_json::from_str(data).unwrap();
            assert!(event.get("error").is_none(), "{event}");
            let i = event["index"].as_u64().expect("an index") as usize;
            last[i] = event["text"].as_str().unwrap().to_string();
        }
        assert_eq!(last, want);
        w.wait_metric("pdserve_kv_blocks_used", 0.0).await;
        w.stop().await;
    })
    .await;
}

/// `/generate` with `n` = 2 on an SGLang prefill/decode pair: each sample meets its own
/// room on both sides (one room `r` read as `r + i + s * inputs`, a room per input as
/// `room + s`), the outputs equal the aggregated ones, a room used twice is refused, and
/// nothing stays pinned or open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generate_samples_meet_their_own_rooms() {
    serial(async {
        let (p, d, port) = bootstrap_pair(&[]).await;
        let agg = TestWorker::start(&[]).await;
        let body = json!({
            "text": ["Once upon a time", "Name a color."],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2},
        });
        let (status, want) = agg.post("/generate", &body).await;
        assert_eq!(status, 200, "{want}");
        let want = generate_texts(&want).0;
        agg.stop().await;

        for room in [json!(900), json!([950, 960])] {
            let mut body = body.clone();
            body["bootstrap_host"] = json!("127.0.0.1");
            body["bootstrap_port"] = json!(port);
            body["bootstrap_room"] = room.clone();
            let (prefilled, decoded) =
                tokio::join!(p.post("/generate", &body), d.post("/generate", &body));
            assert_eq!(prefilled.0, 200, "{}", prefilled.1);
            assert_eq!(decoded.0, 200, "{}", decoded.1);
            assert_eq!(generate_texts(&decoded.1).0, want, "rooms {room}");
        }
        // Per-input rooms 5 and 6 with two samples each: 5, 6 and 6, 7.
        let mut clash = body.clone();
        clash["bootstrap_room"] = json!([5, 6]);
        let (status, err) = d.post("/generate", &clash).await;
        assert_eq!(
            (status, &err["error"]["param"]),
            (400, &json!("bootstrap_room")),
            "{err}"
        );
        assert_clean(&p).await;
        assert_clean(&d).await;
        p.stop().await;
        d.stop().await;
    })
    .await;
}
