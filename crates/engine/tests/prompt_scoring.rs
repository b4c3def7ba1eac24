//! lm-eval's completions requests on a real worker: `echo` with `logprobs` scores the
//! prompt (first token `null`, the rest the model's own log-probabilities, equal to what
//! generation reports for the same token), `max_tokens` 0 scores without generating,
//! vLLM's `prompt_logprobs`, a warm prefix cache changes nothing, streaming echoes the
//! prompt first, and a list of prompts answers one choice per prompt (times `n`) in
//! order with usage summed.

mod support;

use serde_json::{json, Value};
use support::{completion, serial, TestWorker};

fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().unwrap().iter().map(Value::as_f64).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_as_generation_scores_its_tokens() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let prompt = "The capital of France is";
        // What the model generates after the prompt, and that token's logprob.
        let (_, generated) = w
            .post(
                "/v1/completions",
                &completion(prompt, json!({"max_tokens": 1, "logprobs": 2})),
            )
            .await;
        let next = generated["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string();
        let next_lp = generated["choices"][0]["logprobs"]["token_logprobs"][0]
            .as_f64()
            .unwrap();

        // Scoring prompt + that token: its last entry is the same number.
        let scored_text = format!("{prompt}{next}");
        let body = completion(
            &scored_text,
            json!({"max_tokens": 0, "echo": true, "logprobs": 1}),
        );
        let (status, scored) = w.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{scored}");
        let choice = &scored["choices"][0];
        assert_eq!(choice["text"], scored_text.as_str());
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(scored["usage"]["completion_tokens"], 0);
        let n = scored["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let lps = floats(&choice["logprobs"]["token_logprobs"]);
        assert_eq!(lps.len(), n, "{choice}");
        assert_eq!(lps[0], None, "the first prompt token has no logprob");
        assert!(
            lps[1..].iter().all(|l| l.is_some_and(|l| l <= 0.0)),
            "{lps:?}"
        );
        let last = lps[n - 1].unwrap();
        assert!(
            (last - next_lp).abs() < 1e-3,
            "scored {last} vs generated {next_lp}"
        );
        // The greedy token is the top alternative at its own position.
        let top = choice["logprobs"]["top_logprobs"][n - 1]
            .as_object()
            .unwrap();
        assert!(
            top.values().all(|v| v.as_f64().unwrap() <= last + 1e-6),
            "{top:?}"
        );
        assert_eq!(choice["logprobs"]["top_logprobs"][0], Value::Null);
        let offsets = choice["logprobs"]["text_offset"].as_array().unwrap();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|p| p[0].as_u64() <= p[1].as_u64()));

        // Again with the prompt's blocks in the prefix cache: the same numbers.
        let (_, again) = w.post("/v1/completions", &body).await;
        assert_eq!(again["choices"][0]["logprobs"], choice["logprobs"]);

        // vLLM's prompt_logprobs: the same scores, keyed by token id, with the rank.
        let (status, vllm) = w
            .post(
                "/v1/completions",
                &completion(&scored_text, json!({"max_tokens": 1, "prompt_logprobs": 1})),
            )
            .await;
        assert_eq!(status, 200, "{vllm}");
        let listed = vllm["choices"][0]["prompt_logprobs"].as_array().unwrap();
        assert_eq!(listed.len(), n);
        assert_eq!(listed[0], Value::Null);
        let entry = listed[n - 1].as_object().unwrap();
        let own = entry
            .values()
            .find(|v| v["rank"] == 1)
            .expect("the greedy token ranks first");
        assert!(
            (own["logprob"].as_f64().unwrap() - last).abs() < 1e-6,
            "{entry:?}"
        );
        let text = vllm["choices"][0]["text"].as_str().unwrap();
        assert!(
            !text.starts_with(prompt),
            "prompt_logprobs alone does not echo: {text}"
        );

        // Echo with generation: the prompt, then the output, with both logprob parts.
        let (_, both) = w
            .post(
                "/v1/completions",
                &completion(
                    prompt,
                    json!({"max_tokens": 3, "echo": true, "logprobs": 1}),
                ),
            )
            .await;
        let (_, plain) = w
            .post(
                "/v1/completions",
                &completion(prompt, json!({"max_tokens": 3, "logprobs": 1})),
            )
            .await;
        let plain_text = plain["choices"][0]["text"].as_str().unwrap();
        assert_eq!(both["choices"][0]["text"], format!("{prompt}{plain_text}"));
        let both_lps = &both["choices"][0]["logprobs"];
        let k = both["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert_eq!(both_lps["tokens"].as_array().unwrap().len(), k + 3);
        assert_eq!(
            floats(&both_lps["token_logprobs"])[k..],
            floats(&plain["choices"][0]["logprobs"]["token_logprobs"])[..]
        );
        assert_eq!(both_lps["text_offset"][k], prompt.len());

        // Streamed: the prompt comes first; the whole text is the unstreamed one.
        let mut stream_body = completion(
            prompt,
            json!({"max_tokens": 3, "echo": true, "logprobs": 1}),
        );
        stream_body["stream"] = json!(true);
        let text = w
            .http
            .post(format!("{}/v1/completions", w.base))
            .json(&stream_body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(events[0]["choices"][0]["text"], prompt, "{text}");
        assert_eq!(
            events[0]["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .len(),
            k
        );
        let streamed: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(streamed, both["choices"][0]["text"].as_str().unwrap());
        w.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_answers_each_in_order() {
    serial(async {
        let w = TestWorker::start(&[]).await;
        let prompts = ["One, two,", "Red, green,", "Monday, Tuesday,"];
        let mut singles = Vec::new();
        for p in prompts {
            let (_, one) = w.post("/v1/completions", &completion(p, json!({"max_tokens": 4}))).await;
            singles.push(one);
        }
        let (status, batch) = w
            .post("/v1/completions", &completion("", json!({"prompt": prompts, "max_tokens": 4, "n": 2})))
            .await;
        assert_eq!(status, 200, "{batch}");
        let choices = batch["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 6);
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], i);
            assert_eq!(choice["text"], singles[i / 2]["choices"][0]["text"], "choice {i}");
        }
        let sum = |key: &str| singles.iter().map(|s| s["usage"][key].as_u64().unwrap()).sum::<u64>();
        assert_eq!(batch["usage"]["prompt_tokens"], sum("prompt_tokens"));
        assert_eq!(batch["usage"]["completion_tokens"], 2 * sum("completion_tokens"));

        // Token-id prompts echo their decoded text.
        let (_, ids) = w.post("/tokenize", &json!({"prompt": prompts[0]})).await;
        let ids = ids["tokens"].clone();
        let body = json!({"model": "smollm2", "prompt": [ids, ids], "max_tokens": 0, "echo": true, "logprobs": 0});
        let (status, echoed) = w.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{echoed}");
        let echoed = echoed["choices"].as_array().unwrap();
        assert_eq!(echoed.len(), 2);
        assert_eq!(echoed[0]["text"], prompts[0]);
        assert_eq!(echoed[0]["logprobs"], echoed[1]["logprobs"]);

        // One bad prompt fails the whole request and leaves nothing running.
        let body = json!({"model": "smollm2", "prompt": [[1, 2], [999999]], "max_tokens": 1});
        let (status, err) = w.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{err}");
        w.wait_metric("pdserve_engine_running_sequences", 0.0).await;
        w.stop().await;
    })
    .await;
}
