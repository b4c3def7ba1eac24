//! Prefill/decode disaggregation end to end, in one process over real sockets on
//! 127.0.0.1: an aggregated (`both`) worker as the oracle, a `prefill` and a `decode`
//! worker, and the gateway in front of the pair. Greedy output through gateway + P + D
//! must be the aggregated output token for token; a conversation's second turn must
//! reuse the first turn's KV; failed pulls must fail fast; nothing may stay pinned.
//!
//! One test drives every scenario in turn: the workers load the model once, and the
//! final leak check sees the whole suite's traffic.

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use reqwest::Url;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// Bounds the whole suite, model loads included (2 slow CI cores).
const SUITE_DEADLINE: Duration = Duration::from_secs(900);
/// Unread KV is freed this long after it was published (shortened for the test).
const ABORT_TIMEOUT_SECS: u64 = 4;
/// What a failed pull from a dead or garbage-speaking peer may take at most (both fail
/// at once; the connect timeout is 3 s).
const FAILED_PULL_BOUND: Duration = Duration::from_secs(5);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

async fn start_worker(role: &str, model: &Path) -> (Worker, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let args = Cli::try_parse_from([
        "worker",
        "--role",
        role,
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        "smollm2",
        "--threads",
        "1",
        "--num-kv-blocks",
        "256",
        "--kv-abort-timeout",
        &ABORT_TIMEOUT_SECS.to_string(),
    ])
    .unwrap()
    .args;
    let worker = Worker::start(listener, args).await.unwrap();
    let url = format!("http://{}", worker.local_addr());
    (worker, url)
}

struct Stack {
    http: reqwest::Client,
    agg: String,
    prefill: String,
    decode: String,
    gateway: String,
}

impl Stack {
    async fn post(&self, base: &str, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .http
            .post(format!("{base}{path}"))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        if body["stream"] == json!(true) && status == 200 {
            return (status, sse_to_value(&text));
        }
        let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, value)
    }

    async fn ok(&self, base: &str, path: &str, body: &Value) -> Value {
        let (status, value) = self.post(base, path, body).await;
        assert_eq!(status, 200, "{base}{path}: {value}");
        value
    }

    async fn metric(&self, base: &str, name: &str) -> f64 {
        let text = self
            .http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} at {base}"))
    }
}

/// A streamed answer folded into the shape of a non-streamed one: the text (chat
/// `message.content` or completion `text`), plus the final `kv_transfer_params` and
/// the usage event's `usage` (with `stream_options.include_usage`).
fn sse_to_value(body: &str) -> Value {
    let mut text = String::new();
    let mut kv = Value::Null;
    let mut usage = Value::Null;
    let mut chat = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "error event: {chunk}");
        if let Some(choice) = chunk["choices"].get(0) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                chat = true;
                text.push_str(t);
            } else if let Some(t) = choice["text"].as_str() {
                text.push_str(t);
            }
        }
        if !chunk["kv_transfer_params"].is_null() {
            kv = chunk["kv_transfer_params"].clone();
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    if chat {
        json!({"choices": [{"message": {"content": text}}], "kv_transfer_params": kv, "usage": usage})
    } else {
        json!({"choices": [{"text": text}], "kv_transfer_params": kv, "usage": usage})
    }
}

fn text_of(v: &Value) -> String {
    let choice = &v["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn chat(content: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12, "temperature": 0, "stream": stream,
    })
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream})
}

const LONG: &str = "The history of the printing press begins in the fifteenth century, when \
                    Johannes Gutenberg combined movable metal type with oil-based ink and a \
                    screw press. Explain in one sentence why this mattered";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_serving_matches_aggregated_and_leaks_nothing() {
    tokio::time::timeout(SUITE_DEADLINE, suite())
        .await
        .expect("the P/D suite ran past its deadline");
}

async fn suite() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let (agg_worker, agg) = start_worker("both", &model).await;
    let (prefill_worker, prefill) = start_worker("prefill", &model).await;
    let (decode_worker, decode) = start_worker("decode", &model).await;
    assert!(
        agg_worker.kv_addr().is_none(),
        "a plain both worker serves no KV"
    );
    assert!(prefill_worker.kv_addr().is_some() && decode_worker.kv_addr().is_some());

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = format!("http://{}", listener.local_addr().unwrap());
    let config = pdserve_gateway::GatewayConfig::new(
        vec![Url::parse(&prefill).unwrap()],
        vec![Url::parse(&decode).unwrap()],
        Vec::new(),
    );
    let (stop_gateway, stopped) = tokio::sync::oneshot::channel::<()>();
    let gateway_task = tokio::spawn(pdserve_gateway::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let stack = Stack {
        http: reqwest::Client::new(),
        agg,
        prefill,
        decode,
        gateway,
    };

    // First: its leak check must not be masked by other scenarios' expiring exports.
    parallel_choices(&stack).await;
    oracle(&stack).await;
    first_token_from_prefill(&stack).await;
    conditional_disaggregation(&stack).await;
    multi_turn_through_the_gateway(&stack).await;
    multi_turn_by_hand(&stack).await;
    faults(&stack).await;
    aborted_stream(&stack).await;
    no_leaks(&stack).await;

    let _ = stop_gateway.send(());
    gateway_task.await.unwrap().unwrap();
    for worker in [agg_worker, prefill_worker, decode_worker] {
        worker.shutdown().await.unwrap();
    }
}

/// A second gateway with `--disagg-threshold 24` over the same P and D: short prompts go
/// straight to the decode worker (which prefills them itself), long ones through P/D;
/// either way greedy output is the aggregated output token for token.
async fn conditional_disaggregation(stack: &Stack) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = format!("http://{}", listener.local_addr().unwrap());
    let mut config = pdserve_gateway::GatewayConfig::new(
        vec![Url::parse(&stack.prefill).unwrap()],
        vec![Url::parse(&stack.decode).unwrap()],
        Vec::new(),
    );
    config.disagg_threshold = Some(24);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(pdserve_gateway::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let tokens = |v: Value| v["choices"][0]["logprobs"]["tokens"].clone();
    for prompt in ["Hello", LONG] {
        for stream in [false, true] {
            let mut body = completion(prompt, false);
            body["logprobs"] = json!(0);
            body["ignore_eos"] = json!(true);
            let expected = tokens(stack.ok(&stack.agg, "/v1/completions", &body).await);
            if stream {
                body["stream"] = json!(true);
                let text = |v: &Value| text_of(v);
                let agg = text(&stack.ok(&stack.agg, "/v1/completions", &body).await);
                let got = text(&stack.ok(&gateway, "/v1/completions", &body).await);
                assert_eq!(got, agg, "{prompt} streamed");
            } else {
                let got = tokens(stack.ok(&gateway, "/v1/completions", &body).await);
                assert_eq!(got, expected, "{prompt}");
            }
        }
    }
    let skipped = stack
        .metric(
            &gateway,
            r#"pdserve_gateway_disaggregation_total{outcome="prefill_skipped"}"#,
        )
        .await;
    let disaggregated = stack
        .metric(
            &gateway,
            r#"pdserve_gateway_disaggregation_total{outcome="disaggregated"}"#,
        )
        .await;
    assert_eq!((skipped, disaggregated), (2.0, 2.0));
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

/// Every choice's text of an answer with `n` choices, streamed or not, in index order.
fn choice_texts(answer: &Value, stream: bool, n: usize) -> Vec<String> {
    if !stream {
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), n, "{answer}");
        return choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i, "{answer}");
                text_of(&json!({"choices": [c]}))
            })
            .collect();
    }
    let mut texts = vec![String::new(); n];
    for chunk in answer["chunks"].as_array().unwrap() {
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            let t = c["delta"]["content"].as_str().or(c["text"].as_str());
            texts[i].push_str(t.unwrap_or(""));
        }
    }
    texts
}

/// `n` = 2 through gateway + P + D: the gateway sends each choice as its own pair of
/// legs (vLLM's decode reads one handle once per choice), so P publishes two handles and
/// D imports each once; every choice equals the aggregated worker's choice, which equals
/// its `n` = 1 answer, and the usage counts the prompt once. Then nothing stays pinned on
/// P or D, and P's exports were read, not expired.
async fn parallel_choices(stack: &Stack) {
    let cases = [
        ("/v1/chat/completions", chat(LONG, false)),
        ("/v1/completions", completion("Once upon a time", false)),
        ("/v1/completions", completion(LONG, false)),
    ];
    for (path, body) in cases {
        let single = text_of(&stack.ok(&stack.agg, path, &body).await);
        let mut body = body;
        body["n"] = json!(2);
        let expected = choice_texts(&stack.ok(&stack.agg, path, &body).await, false, 2);
        assert_eq!(expected, vec![single; 2], "{path}");
        for stream in [false, true] {
            body["stream"] = json!(stream);
            let published = || stack.metric(&stack.prefill, "pdserve_kv_transfer_published_total");
            let imported =
                || stack.metric(&stack.decode, "pdserve_kv_transfer_imported_tokens_total");
            let (published_before, imported_before) = (published().await, imported().await);
            let mut prompt_tokens = None;
            let got = if stream {
                let raw = stack
                    .http
                    .post(format!("{}{path}", stack.gateway))
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap();
                assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
                let chunks: Vec<Value> = raw
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .map(|d| serde_json::from_str(d).unwrap())
                    .collect();
                assert!(chunks.iter().all(|c| c.get("error").is_none()), "{raw}");
                choice_texts(&json!({ "chunks": chunks }), true, 2)
            } else {
                let answer = stack.ok(&stack.gateway, path, &body).await;
                let aggregated = stack.ok(&stack.agg, path, &body).await;
                assert_eq!(
                    answer["usage"]["prompt_tokens"],
                    aggregated["usage"]["prompt_tokens"]
                );
                assert_eq!(
                    answer["usage"]["total_tokens"],
                    aggregated["usage"]["total_tokens"]
                );
                prompt_tokens = answer["usage"]["prompt_tokens"].as_f64();
                choice_texts(&answer, false, 2)
            };
            assert_eq!(got, expected, "{path} n=2 stream={stream}");
            // One prefill per choice published on P, each imported once on D.
            assert_eq!(published().await - published_before, 2.0, "{path}");
            if let Some(prompt_tokens) = prompt_tokens {
                let imported = imported().await - imported_before;
                assert_eq!(
                    imported,
                    2.0 * (prompt_tokens - 1.0),
                    "{path}: imported once a choice"
                );
            }
        }
    }
    // Released at once (well inside the abort timeout): read by D, not expired.
    let started = Instant::now();
    for base in [&stack.prefill, &stack.decode] {
        loop {
            let pinned = stack.metric(base, "pdserve_kv_blocks_pinned").await;
            let published = stack
                .metric(base, "pdserve_kv_transfer_pinned_blocks")
                .await;
            if pinned == 0.0 && published == 0.0 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(ABORT_TIMEOUT_SECS / 2),
                "{base}: {pinned} blocks pinned, {published} published after n = 2"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let expired = stack
        .metric(
            &stack.prefill,
            "pdserve_kv_transfer_aborted_by_timeout_total",
        )
        .await;
    assert_eq!(expired, 0.0, "an n = 2 prefill's export expired unread");
}

/// Chat and completions, streamed and not, prompts of one token, of under one block
/// and of several blocks: P/D text equals the aggregated text.
async fn oracle(stack: &Stack) {
    let cases = [
        ("/v1/chat/completions", chat("Hi", false)),
        ("/v1/chat/completions", chat(LONG, false)),
        ("/v1/completions", completion("Hello", false)),
        ("/v1/completions", completion("Once upon a time", false)),
        ("/v1/completions", completion(LONG, false)),
    ];
    for (path, body) in cases {
        let expected = text_of(&stack.ok(&stack.agg, path, &body).await);
        assert!(!expected.is_empty(), "{path} {body}");
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let got = stack.ok(&stack.gateway, path, &body).await;
            assert_eq!(text_of(&got), expected, "{path} stream={stream} {body}");
        }
    }
    // Token for token, not only the same text.
    let mut body = completion(LONG, false);
    body["logprobs"] = json!(0);
    body["ignore_eos"] = json!(true);
    let tokens = |v: Value| v["choices"][0]["logprobs"]["tokens"].clone();
    let expected = tokens(stack.ok(&stack.agg, "/v1/completions", &body).await);
    assert_eq!(expected.as_array().map(Vec::len), Some(12), "{expected}");
    let got = tokens(stack.ok(&stack.gateway, "/v1/completions", &body).await);
    assert_eq!(got, expected);
    let imported = stack
        .metric(&stack.decode, "pdserve_kv_transfer_imported_tokens_total")
        .await;
    assert!(imported > 100.0, "decode imported only {imported} tokens");
}

/// One raw SSE answer: per choice its text and its tokens (completions' logprobs), the
/// usage event's `usage`, and the first event's text of choice 0.
struct Streamed {
    texts: Vec<String>,
    tokens: Vec<Vec<Value>>,
    usage: Value,
    first_text: String,
}

async fn streamed(stack: &Stack, base: &str, path: &str, body: &Value, n: usize) -> Streamed {
    let raw = stack
        .http
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
    let mut out = Streamed {
        texts: vec![String::new(); n],
        tokens: vec![Vec::new(); n],
        usage: Value::Null,
        first_text: String::new(),
    };
    let mut first = true;
    for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{raw}");
        if !chunk["usage"].is_null() {
            out.usage = chunk["usage"].clone();
        }
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            let t = c["delta"]["content"].as_str().or(c["text"].as_str());
            let t = t.unwrap_or("");
            if first && i == 0 && !t.is_empty() {
                out.first_text = t.to_string();
                first = false;
            }
            out.texts[i].push_str(t);
            if let Some(tokens) = c["logprobs"]["tokens"].as_array() {
                out.tokens[i].extend(tokens.iter().cloned());
            }
        }
    }
    out
}

/// Streamed P/D answers take their first token from the prefill leg (on by default for
/// pdserve workers): the first event carries the prefill answer's token, and the whole
/// answer equals the aggregated stream token for token, with the same usage, for greedy
/// and for seeded sampling with `n` = 2; a request's `"first_token_from_prefill": false`
/// turns it off.
async fn first_token_from_prefill(stack: &Stack) {
    let counted = || {
        stack.metric(
            &stack.gateway,
            "pdserve_gateway_first_token_from_prefill_total",
        )
    };
    let mut greedy = completion(LONG, true);
    greedy["logprobs"] = json!(0);
    greedy["ignore_eos"] = json!(true);
    greedy["stream_options"] = json!({"include_usage": true});
    let mut sampled = chat(LONG, true);
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(11);
    sampled["n"] = json!(2);
    sampled["stream_options"] = json!({"include_usage": true});
    let cases = [
        ("/v1/completions", greedy, 1),
        ("/v1/chat/completions", chat(LONG, true), 1),
        ("/v1/chat/completions", sampled, 2),
    ];
    for (path, body, n) in cases {
        let expected = streamed(stack, &stack.agg, path, &body, n).await;
        let before = counted().await;
        let got = streamed(stack, &stack.gateway, path, &body, n).await;
        // One count per choice: each has its own prefill leg.
        assert_eq!(
            counted().await - before,
            n as f64,
            "{path}: not from prefill"
        );
        assert_eq!(got.texts, expected.texts, "{path} {body}");
        assert_eq!(got.tokens, expected.tokens, "{path} {body}");
        assert_eq!(got.first_text, expected.first_text, "{path} {body}");
        for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(got.usage[count], expected.usage[count], "{path} {count}");
        }

        let mut off = body.clone();
        off["first_token_from_prefill"] = json!(false);
        let before = counted().await;
        let got = streamed(stack, &stack.gateway, path, &off, n).await;
        assert_eq!(counted().await - before, 0.0, "{path}: turned off");
        assert_eq!(got.texts, expected.texts, "{path} off");
    }
    let mismatches = stack
        .metric(&stack.gateway, "pdserve_gateway_first_token_mismatch_total")
        .await;
    assert_eq!(mismatches, 0.0);
}

/// Turn 2 of a conversation through the gateway: P reads turn 1's KV from D, and the
/// client's usage counts those tokens as cached (computed by no one for this request) as
/// the aggregated worker's prefix cache does for the same conversation, within a block;
/// streamed (the usage event) and not. A cold prompt reports nothing cached, a new
/// conversation what the aggregated worker reports (the chat template's shared start).
async fn multi_turn_through_the_gateway(stack: &Stack) {
    let path = "/v1/chat/completions";
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
    };
    // A completion prompt (no template) no worker has seen: nothing of it is cached.
    let cold = completion(&format!("Never seen before: {LONG}"), false);
    let cold = stack.ok(&stack.gateway, "/v1/completions", &cold).await;
    assert_eq!(cached(&cold), 0, "a cold prompt: {cold}");
    for (stream, conversation) in [(false, "conversation-1"), (true, "conversation-2")] {
        let mut turn = chat(
            // Unique from its first token: the workers have seen LONG already.
            &format!("({conversation}, streamed: {stream}) {LONG}"),
            stream,
        );
        turn["conversation_id"] = json!(conversation);
        if stream {
            turn["stream_options"] = json!({"include_usage": true});
        }
        let user = turn["messages"][0]["content"].clone();
        // The chat template's system prompt is the one block every chat shares: the
        // aggregated worker's cache hits on a new conversation are what P/D must report.
        let mut agg_first = chat(user.as_str().unwrap(), stream);
        if stream {
            agg_first["stream_options"] = json!({"include_usage": true});
        }
        let agg_first = stack.ok(&stack.agg, path, &agg_first).await;
        let first = stack.ok(&stack.gateway, path, &turn).await;
        assert_eq!(
            cached(&first),
            cached(&agg_first),
            "a new conversation: {first}"
        );
        assert_eq!(
            first["usage"]["pdserve"]["earlier_turn_tokens"].as_u64(),
            Some(0),
            "{first}"
        );
        let first_text = text_of(&first);
        assert_eq!(text_of(&agg_first), first_text);
        let before = stack
            .metric(&stack.prefill, "pdserve_kv_transfer_imported_tokens_total")
            .await;
        turn["messages"] = json!([
            {"role": "user", "content": user},
            {"role": "assistant", "content": first_text},
            {"role": "user", "content": "Now say it in five words."},
        ]);
        let second = stack.ok(&stack.gateway, path, &turn).await;
        let reused = stack
            .metric(&stack.prefill, "pdserve_kv_transfer_imported_tokens_total")
            .await
            - before;
        assert!(
            reused > 32.0,
            "prefill reused only {reused} tokens of turn 1"
        );
        let pd_cached = cached(&second);
        assert_eq!(
            pd_cached as f64, reused,
            "the turn-1 tokens P reused are the client's cached tokens: {second}"
        );
        let details = &second["usage"]["pdserve"];
        assert_eq!(
            details["earlier_turn_tokens"].as_u64(),
            Some(pd_cached),
            "{second}"
        );
        assert_eq!(details["prefix_cache_tokens"].as_u64(), Some(0), "{second}");

        // The same conversation on the aggregated worker: same text, and its prefix cache
        // holds turn 1's full blocks.
        let mut agg_turn = turn.clone();
        agg_turn.as_object_mut().unwrap().remove("conversation_id");
        let expected = stack.ok(&stack.agg, path, &agg_turn).await;
        assert_eq!(text_of(&second), text_of(&expected));
        let agg_cached = cached(&expected);
        assert!(
            pd_cached.abs_diff(agg_cached) < 16,
            "P/D reports {pd_cached} cached tokens, aggregated {agg_cached} (stream: {stream})"
        );
    }

    // Turn 2 after the decode worker freed turn 1's blocks (its abort timeout passed; the
    // gateway still holds the handle): P finds them gone and computes the prompt itself,
    // and the answer is still the aggregated one.
    let user = format!("(conversation-3, stale) {LONG}");
    let mut turn = chat(&user, false);
    turn["conversation_id"] = json!("conversation-3");
    let first = text_of(&stack.ok(&stack.gateway, path, &turn).await);
    tokio::time::sleep(Duration::from_secs(ABORT_TIMEOUT_SECS + 2)).await;
    turn["messages"] = json!([
        {"role": "user", "content": user},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Now say it in five words."},
    ]);
    let second = stack.ok(&stack.gateway, path, &turn).await;
    let mut agg_turn = turn.clone();
    agg_turn.as_object_mut().unwrap().remove("conversation_id");
    let expected = stack.ok(&stack.agg, path, &agg_turn).await;
    assert_eq!(text_of(&second), text_of(&expected));
}

/// The same flow as vLLM's multi-turn proxy drives it, checking each leg's answer.
async fn multi_turn_by_hand(stack: &Stack) {
    let path = "/v1/completions";
    let prompt1 = format!("{LONG}.");
    let mut p1 = completion(&prompt1, false);
    p1["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let p1 = stack.ok(&stack.prefill, path, &p1).await;
    let kv = &p1["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true, "{p1}");
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(kv["tp_size"], 1);
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert!(kv["remote_port"].as_u64().unwrap() > 0);
    assert!(kv["remote_engine_id"].is_string() && kv["remote_request_id"].is_string());
    let groups = kv["remote_block_ids"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "one list per KV-cache group: {kv}");
    assert!(groups[0].as_array().unwrap().len() >= 2, "{kv}");
    assert_eq!(
        p1["usage"]["completion_tokens"], 1,
        "prefill computes one token"
    );

    let mut d1 = completion(&prompt1, true);
    d1["kv_transfer_params"] = kv.clone();
    let d1 = stack.ok(&stack.decode, path, &d1).await;
    let hand_back = d1["kv_transfer_params"].clone();
    assert_eq!(hand_back["do_remote_prefill"], false, "{d1}");
    assert!(hand_back["remote_request_id"].is_string(), "{d1}");

    // Turn 2 extends turn 1's prompt and output.
    let prompt2 = format!("{prompt1}{} And then?", text_of(&d1));
    let mut p2 = completion(&prompt2, false);
    let mut reuse = hand_back.clone();
    reuse["do_remote_decode"] = json!(true);
    reuse["do_remote_prefill"] = json!(false);
    p2["kv_transfer_params"] = reuse;
    let p2 = stack.ok(&stack.prefill, path, &p2).await;
    // KV read from the last turn's decode worker is imported, and cached: no one
    // computed it for this request.
    let imported_now = p2["usage"]["pdserve"]["kv_imported_tokens"]
        .as_u64()
        .unwrap_or(0);
    let prompt_tokens = p2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        imported_now > 32 && imported_now < prompt_tokens,
        "turn 2 reused {imported_now} of {prompt_tokens} prompt tokens: {p2}"
    );
    assert_eq!(
        p2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(imported_now),
        "{p2}"
    );
    assert_eq!(
        p2["usage"]["pdserve"]["earlier_turn_tokens"].as_u64(),
        Some(imported_now),
        "{p2}"
    );
    let mut d2 = completion(&prompt2, false);
    d2["kv_transfer_params"] = p2["kv_transfer_params"].clone();
    let d2 = stack.ok(&stack.decode, path, &d2).await;
    // The decode worker imported P's KV, of which P computed none of turn 1's part.
    assert_eq!(
        d2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(imported_now),
        "{d2}"
    );
    let expected = stack
        .ok(&stack.agg, path, &completion(&prompt2, false))
        .await;
    assert_eq!(text_of(&d2), text_of(&expected));

    // The hand-back was read once; reading it again is refused and P computes alone.
    let imported = stack
        .metric(&stack.prefill, "pdserve_kv_transfer_imported_tokens_total")
        .await;
    let mut again = completion(&prompt2, false);
    let mut stale = hand_back;
    stale["do_remote_decode"] = json!(true);
    again["kv_transfer_params"] = stale;
    let again = stack.ok(&stack.prefill, path, &again).await;
    let imported_again = stack
        .metric(&stack.prefill, "pdserve_kv_transfer_imported_tokens_total")
        .await;
    assert_eq!(
        imported, imported_again,
        "a read-once hand-back was read twice"
    );
    // Leave P's export of `again` unread: the abort timeout frees it (checked at the end).
    assert!(again["kv_transfer_params"]["remote_request_id"].is_string());
}

/// A decode pull from a dead peer, a garbage-speaking peer, with a mismatched prompt,
/// or with incomplete params fails with an OpenAI-shaped error in bounded time.
async fn faults(stack: &Stack) {
    let path = "/v1/completions";
    let dead_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let garbage = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let garbage_port = garbage.local_addr().unwrap().port();
    let garbage_task = tokio::spawn(async move {
        while let Ok((mut socket, _)) = garbage.accept().await {
            let _ = socket
                .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot KV")
                .await;
        }
    });
    let handle = |port: u16| {
        json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "someone", "remote_block_ids": [[0, 1]],
            "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "r-1",
            "tp_size": 1})
    };
    for (what, port) in [("dead", dead_port), ("garbage", garbage_port)] {
        let mut body = completion(LONG, false);
        body["kv_transfer_params"] = handle(port);
        let started = Instant::now();
        let (status, err) = stack.post(&stack.decode, path, &body).await;
        assert!(
            started.elapsed() < FAILED_PULL_BOUND,
            "{what} peer: too slow"
        );
        assert!(
            status == 502 || status == 504,
            "{what} peer: {status} {err}"
        );
        assert!(
            err["error"]["message"].as_str().unwrap().contains("KV"),
            "{err}"
        );
    }
    garbage_task.abort();

    let mut incomplete = completion(LONG, false);
    incomplete["kv_transfer_params"] = json!({"do_remote_prefill": true});
    let (status, err) = stack.post(&stack.decode, path, &incomplete).await;
    assert_eq!(status, 400, "{err}");

    // A decode request for another prompt than the one prefilled: detected, not decoded.
    let mut p = completion(LONG, false);
    p["kv_transfer_params"] = json!({"do_remote_decode": true});
    let p = stack.ok(&stack.prefill, path, &p).await;
    let mut d = completion(
        "A different prompt entirely, about cooking pasta well.",
        false,
    );
    d["kv_transfer_params"] = p["kv_transfer_params"].clone();
    let (status, err) = stack.post(&stack.decode, path, &d).await;
    assert_eq!(status, 502, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("another prompt"),
        "{err}"
    );
}

/// A client that drops a P/D stream mid-way leaves no pinned block behind.
async fn aborted_stream(stack: &Stack) {
    let mut body = chat(LONG, true);
    body["max_tokens"] = json!(200);
    body["ignore_eos"] = json!(true);
    let mut response = stack
        .http
        .post(format!("{}/v1/chat/completions", stack.gateway))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.chunk().await.unwrap().is_some());
    drop(response);
}

/// After everything above (and the abort timeout), no worker holds a pinned block.
async fn no_leaks(stack: &Stack) {
    let started = Instant::now();
    let limit = Duration::from_secs(ABORT_TIMEOUT_SECS + 10);
    for base in [&stack.agg, &stack.prefill, &stack.decode] {
        loop {
            let pinned = stack.metric(base, "pdserve_kv_blocks_pinned").await;
            let published = stack
                .metric(base, "pdserve_kv_transfer_pinned_blocks")
                .await;
            let running = stack.metric(base, "pdserve_num_requests_running").await;
            if pinned == 0.0 && published == 0.0 && running == 0.0 {
                break;
            }
            assert!(
                started.elapsed() < limit,
                "{base}: {pinned} blocks pinned, {published} published, {running} running"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let aborted = stack
        .metric(
            &stack.prefill,
            "pdserve_kv_transfer_aborted_by_timeout_total",
        )
        .await;
    assert!(
        aborted >= 1.0,
        "the unread export was not freed by the timeout"
    );
}
