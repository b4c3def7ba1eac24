//! lm-evaluation-harness's `local-completions` requests replayed against one aggregated
//! worker (the oracle) and against `pdserve up` in each P/D protocol — vLLM's sequential
//! handoff, SGLang's bootstrap, decode as orchestrator: log-likelihood (`echo` with
//! `logprobs`, `max_tokens` 1, batches of token-id prompts), prompt scoring with
//! `max_tokens` 0, vLLM's `prompt_logprobs`, generation with `stop` over a batch of text
//! prompts, and a streamed echo. Every stack answers with the oracle's choices, texts and
//! log-probabilities (to 1e-4). A small multiple-choice task (`data/mini_mc.jsonl`) is
//! scored the way lm-eval scores it: the same per-item log-likelihoods and accuracy on
//! every stack (printed, for the record).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "support/up.rs"]
mod up;
#[path = "support/worker.rs"]
mod worker;

use up::Up;

/// lm-eval's batch size for the log-likelihood requests.
const BATCH: usize = 16;
/// Log-probabilities agree to this.
const TOLERANCE: f64 = 1e-4;

/// One multiple-choice item of the task file.
struct Item {
    question: String,
    choices: Vec<String>,
    answer: usize,
}

/// A log-likelihood request's prompt: context then continuation ids, and where the
/// continuation starts.
struct Scored {
    ids: Vec<u64>,
    context_len: usize,
}

async fn post(http: &reqwest::Client, base: &str, path: &str, body: &Value) -> Value {
    let response = http
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{base}{path}: {e}"));
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{base}{path} {body}: {status} {text}");
    if body["stream"] == json!(true) {
        return fold_stream(&text);
    }
    serde_json::from_str(&text).unwrap()
}

/// A streamed completion folded into its choices (by `index`): text and logprob columns
/// concatenated.
fn fold_stream(body: &str) -> Value {
    let mut choices: Vec<Value> = Vec::new();
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "error event: {chunk}");
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap() as usize;
            while choices.len() <= index {
                choices.push(json!({"index": choices.len(), "text": "",
                    "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}));
            }
            let folded = &mut choices[index];
            let text = folded["text"].as_str().unwrap().to_string()
                + choice["text"].as_str().unwrap_or("");
            folded["text"] = json!(text);
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                if let Some(items) = choice["logprobs"][key].as_array() {
                    folded["logprobs"][key]
                        .as_array_mut()
                        .unwrap()
                        .extend(items.iter().cloned());
                }
            }
            if !choice["finish_reason"].is_null() {
                folded["finish_reason"] = choice["finish_reason"].clone();
            }
        }
    }
    json!({"choices": choices})
}

/// Equal JSON, numbers to [`TOLERANCE`].
fn assert_close(want: &Value, got: &Value, at: &str) {
    match (want, got) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() <= TOLERANCE, "{at}: {a} vs {b}");
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{at}: lengths");
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert_close(a, b, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(a), Value::Object(b)) => {
            let keys = |o: &serde_json::Map<String, Value>| {
                let mut k: Vec<String> = o.keys().cloned().collect();
                k.sort();
                k
            };
            assert_eq!(keys(a), keys(b), "{at}: fields");
            for (k, v) in a {
                assert_close(v, &b[k], &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(want, got, "{at}"),
    }
}

/// What of an answer must match: its choices and the token counts.
fn comparable(answer: &Value) -> Value {
    let mut choices = answer["choices"].clone();
    for choice in choices.as_array_mut().unwrap() {
        choice.as_object_mut().unwrap().remove("stop_reason");
    }
    json!({
        "choices": choices,
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "completion_tokens": answer["usage"]["completion_tokens"],
    })
}

/// lm-eval's log-likelihood requests: batches of [`BATCH`] token-id prompts.
fn loglikelihood_requests(prompts: &[Scored]) -> Vec<Value> {
    prompts
        .chunks(BATCH)
        .map(|batch| {
            let ids: Vec<&Vec<u64>> = batch.iter().map(|s| &s.ids).collect();
            json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                   "echo": true, "seed": 1234})
        })
        .collect()
}

/// The other request shapes lm-eval and vLLM's clients send.
fn other_requests() -> Vec<Value> {
    vec![
        // generate_until over a batch of text prompts, cut at stop strings.
        json!({"prompt": ["Question: What is two plus two?\nAnswer:", "The capital of France is"],
               "max_tokens": 16, "temperature": 0, "stop": ["\n", "."], "seed": 1234}),
        // Prompt scoring alone.
        json!({"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 0,
               "echo": true, "logprobs": 2}),
        // vLLM's prompt_logprobs, with two generated tokens.
        json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
               "prompt_logprobs": 1, "logprobs": 1}),
        // A streamed echo.
        json!({"prompt": "One, two, three,", "max_tokens": 4, "temperature": 0,
               "echo": true, "logprobs": 1, "stream": true}),
        // A streamed batch with two choices per prompt.
        json!({"prompt": ["Red, green,", "Cats and"], "n": 2, "max_tokens": 4,
               "temperature": 0, "logprobs": 1, "stream": true}),
        // Text prompts scored with echo, as a batch.
        json!({"prompt": ["Paris is in France.", "Rome is in Italy."], "max_tokens": 1,
               "temperature": 0, "echo": true, "logprobs": 1}),
    ]
}

/// lm-eval's score of one prompt: the continuation's log-probabilities summed (the last
/// entry, the one generated token, left out).
fn loglikelihood(choice: &Value, context_len: usize) -> f64 {
    let lps = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    lps[context_len..lps.len() - 1]
        .iter()
        .map(|v| v.as_f64().expect("continuation tokens are scored"))
        .sum()
}

/// Every answer of a stack: the log-likelihood batches, then the other shapes.
async fn replay(http: &reqwest::Client, base: &str, requests: &[Value]) -> Vec<Value> {
    let mut answers = Vec::new();
    for body in requests {
        answers.push(post(http, base, "/v1/completions", body).await);
    }
    answers
}

/// The task's per-item log-likelihoods and accuracy from the log-likelihood answers.
fn score(items: &[Item], prompts: &[Scored], answers: &[Value]) -> (Vec<Vec<f64>>, f64) {
    let choices: Vec<&Value> = answers
        .iter()
        .take(prompts.len().div_ceil(BATCH))
        .flat_map(|a| a["choices"].as_array().unwrap())
        .collect();
    assert_eq!(choices.len(), prompts.len());
    let mut k = 0;
    let mut correct = 0;
    let mut lls = Vec::new();
    for item in items {
        let scores: Vec<f64> = (0..item.choices.len())
            .map(|j| loglikelihood(choices[k + j], prompts[k + j].context_len))
            .collect();
        k += item.choices.len();
        let best = (0..scores.len())
            .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
            .unwrap();
        correct += (best == item.answer) as usize;
        lls.push(scores);
    }
    (lls, correct as f64 / items.len() as f64)
}

/// A batch with one prompt the workers refuse fails whole (the worker's 400), and every
/// prefill's KV is freed: no worker keeps a pinned block.
async fn fails_whole_and_frees_kv(http: &reqwest::Client, up: &Up, good: &[u64]) {
    let body = json!({"prompt": [good, good, [999_999]], "max_tokens": 2, "temperature": 0});
    let response = http
        .post(format!("{}/v1/completions", up.entry))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"]["message"].is_string(), "{answer}");
    assert!(!up.workers.is_empty());
    let deadline = Instant::now() + Duration::from_secs(20);
    for worker in &up.workers {
        loop {
            let text = http
                .get(format!("{worker}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let pinned: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix("pdserve_kv_blocks_pinned ")?.parse().ok())
                .unwrap_or_else(|| panic!("no pinned-block gauge at {worker}"));
            if pinned == 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{worker} keeps {pinned} pinned blocks"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[test]
fn lm_eval_requests_answer_alike_aggregated_and_through_every_p_d_protocol() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let items: Vec<Item> = include_str!("data/mini_mc.jsonl")
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Item {
                question: v["question"].as_str().unwrap().to_string(),
                choices: v["choices"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_str().unwrap().to_string())
                    .collect(),
                answer: v["answer"].as_u64().unwrap() as usize,
            }
        })
        .collect();

    // The oracle: one aggregated worker.
    let (oracle, oracle_url) = rt.block_on(worker::start_worker(
        "prefill_decode",
        &model,
        &["--num-kv-blocks", "512"],
    ));
    let tokenize = |text: &str| -> Vec<u64> {
        let body = json!({"prompt": text, "add_special_tokens": false});
        let answer = rt.block_on(post(&http, &oracle_url, "/tokenize", &body));
        answer["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let mut prompts = Vec::new();
    for item in &items {
        let context = tokenize(&item.question);
        for choice in &item.choices {
            let mut ids = context.clone();
            ids.extend(tokenize(choice));
            prompts.push(Scored {
                ids,
                context_len: context.len(),
            });
        }
    }
    let mut requests = loglikelihood_requests(&prompts);
    requests.extend(other_requests());
    let want = rt.block_on(replay(&http, &oracle_url, &requests));
    let (want_lls, want_accuracy) = score(&items, &prompts, &want);
    rt.block_on(oracle.shutdown()).unwrap();
    eprintln!(
        "aggregated worker: accuracy {want_accuracy:.3} on {} items ({} prompts scored)",
        items.len(),
        prompts.len()
    );
    assert!(want_accuracy > 0.5, "the task is easy: {want_accuracy}");

    for flags in [
        &[][..],
        &["--protocol", "sglang"][..],
        &["--topology", "orchestrator"][..],
    ] {
        let up = Up::start(&model, flags);
        let got = rt.block_on(replay(&http, &up.entry, &requests));
        for (i, (want, got)) in want.iter().zip(&got).enumerate() {
            assert_close(
                &comparable(want),
                &comparable(got),
                &format!("up {flags:?} request {i} ({})", requests[i]),
            );
        }
        let (lls, accuracy) = score(&items, &prompts, &got);
        let worst = want_lls
            .iter()
            .flatten()
            .zip(lls.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "pdserve up {flags:?}: accuracy {accuracy:.3}, largest log-likelihood difference {worst:.2e}"
        );
        assert_eq!(accuracy, want_accuracy);
        rt.block_on(fails_whole_and_frees_kv(&http, &up, &prompts[0].ids));
        up.stop();
    }
}
