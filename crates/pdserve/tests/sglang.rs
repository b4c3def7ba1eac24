//! SGLang's bootstrap handoff end to end, in one process over real sockets on 127.0.0.1:
//! an aggregated worker as the oracle, a prefill worker with a bootstrap port, a decode
//! worker, and the gateway with `--protocol sglang` in front of the pair. Greedy output
//! through gateway + P + D must equal the aggregated output (chat and completions,
//! streamed or not, `n` = 2 too, and a native `/generate` batch, one room per item);
//! afterwards the workers hold no pinned blocks and no open rooms.

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use pdserve_gateway::config::Protocol;
use reqwest::Url;
use serde_json::{json, Value};
use tokio::net::TcpListener;

#[path = "support/openai.rs"]
#[allow(dead_code)]
mod openai;

use openai::{chat, completion, sse_to_value, text_of};

/// Bounds the whole suite, model loads included (2 slow CI cores).
const SUITE_DEADLINE: Duration = Duration::from_secs(900);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

async fn start_worker(role: &str, model: &Path, extra: &[&str]) -> (Worker, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let model = model.display().to_string();
    let mut argv = vec![
        "worker",
        "--role",
        role,
        "--model",
        &model,
        "--served-model-name",
        "smollm2",
        "--threads",
        "1",
        "--num-kv-blocks",
        "256",
        "--bootstrap-timeout-secs",
        "10",
    ];
    argv.extend_from_slice(extra);
    let args = Cli::try_parse_from(argv).unwrap().args;
    let worker = Worker::start(listener, args).await.unwrap();
    let url = format!("http://{}", worker.local_addr());
    (worker, url)
}

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

struct Stack {
    http: reqwest::Client,
    agg: String,
    gateway: String,
}

impl Stack {
    async fn ok(&self, base: &str, path: &str, body: &Value) -> String {
        let response = self
            .http
            .post(format!("{base}{path}"))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{base}{path}: {text}");
        text
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

const LONG: &str = "The history of the printing press begins in the fifteenth century, when \
                    Johannes Gutenberg combined movable metal type with oil-based ink and a \
                    screw press. Explain in one sentence why this mattered";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_handoff_matches_aggregated_and_leaks_nothing() {
    tokio::time::timeout(SUITE_DEADLINE, suite())
        .await
        .expect("the SGLang suite ran past its deadline");
}

async fn suite() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let bootstrap_port = free_port();
    let port = bootstrap_port.to_string();
    let (agg_worker, agg) = start_worker("both", &model, &[]).await;
    let (prefill_worker, prefill) =
        start_worker("prefill", &model, &["--bootstrap-port", &port]).await;
    let (decode_worker, decode) = start_worker("decode", &model, &[]).await;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = format!("http://{}", listener.local_addr().unwrap());
    let mut config = pdserve_gateway::GatewayConfig::new(
        vec![Url::parse(&prefill).unwrap()],
        vec![Url::parse(&decode).unwrap()],
        Vec::new(),
    );
    config.protocol = Protocol::Sglang;
    config.prefill_bootstrap_ports = vec![Some(bootstrap_port)];
    let (stop_gateway, stopped) = tokio::sync::oneshot::channel::<()>();
    let gateway_task = tokio::spawn(pdserve_gateway::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let stack = Stack {
        http: reqwest::Client::new(),
        agg,
        gateway,
    };

    openai_routes(&stack).await;
    cached_tokens(&stack).await;
    parallel_choices(&stack).await;
    native_batch(&stack).await;
    let transferred = stack
        .metric(
            &prefill,
            r#"pdserve_bootstrap_rooms_total{outcome="transferred"}"#,
        )
        .await;
    assert!(transferred >= 18.0, "only {transferred} rooms transferred");
    no_leaks(&stack, &[&prefill, &decode]).await;

    let _ = stop_gateway.send(());
    gateway_task.await.unwrap().unwrap();
    for worker in [agg_worker, prefill_worker, decode_worker] {
        worker.shutdown().await.unwrap();
    }
}

/// Chat and completions, streamed and not: the same text as the aggregated worker.
async fn openai_routes(stack: &Stack) {
    let cases = [
        ("/v1/chat/completions", chat("Hi", false)),
        ("/v1/chat/completions", chat(LONG, false)),
        ("/v1/completions", completion("Once upon a time", false)),
        ("/v1/completions", completion(LONG, false)),
    ];
    for (path, body) in cases {
        let expected =
            text_of(&serde_json::from_str(&stack.ok(&stack.agg, path, &body).await).unwrap());
        assert!(!expected.is_empty(), "{path} {body}");
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let text = stack.ok(&stack.gateway, path, &body).await;
            let got = if stream {
                assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
                sse_to_value(&text)
            } else {
                serde_json::from_str(&text).unwrap()
            };
            assert_eq!(text_of(&got), expected, "{path} stream={stream}");
        }
    }
}

/// A prompt sent twice: the second time the prefill worker finds it in its prefix cache,
/// and the client's usage (the decode worker's answer) counts those tokens as cached,
/// as the aggregated worker does for the same prompt. The first time nothing is cached.
async fn cached_tokens(stack: &Stack) {
    let path = "/v1/completions";
    let body = completion(&format!("In the SGLang mode's words: {LONG}"), false);
    let cached = |text: String| {
        let v: Value = serde_json::from_str(&text).unwrap();
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
    };
    let cold = cached(stack.ok(&stack.gateway, path, &body).await);
    let warm = cached(stack.ok(&stack.gateway, path, &body).await);
    stack.ok(&stack.agg, path, &body).await;
    let expected = cached(stack.ok(&stack.agg, path, &body).await);
    assert_eq!(cold, 0, "a cold prompt");
    assert!(
        expected >= 16,
        "the aggregated worker hit {expected} tokens"
    );
    assert_eq!(
        warm, expected,
        "P/D reports the prefill worker's prefix-cache hits"
    );
}

/// Every choice's text of an answer, streamed (folded by `index`) or not.
fn choice_texts(answer: &str, stream: bool) -> Vec<String> {
    if !stream {
        let v: Value = serde_json::from_str(answer).unwrap();
        let choices = v["choices"].as_array().unwrap_or_else(|| panic!("{v}"));
        return choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i, "{v}");
                c["message"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap()
                    .to_string()
            })
            .collect();
    }
    assert!(answer.ends_with("data: [DONE]\n\n"), "{answer}");
    let mut texts: Vec<String> = Vec::new();
    let mut finishes = 0;
    for data in answer.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
            }
            let piece = c["delta"]["content"].as_str().or(c["text"].as_str());
            texts[i].push_str(piece.unwrap_or(""));
            finishes += c["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(
        finishes,
        texts.len(),
        "one finish chunk per choice: {answer}"
    );
    texts
}

/// `n` = 2 through gateway + P + D (a room per choice for chat, one room read as
/// room + i for a completion): every choice equals the aggregated worker's, and the
/// aggregated worker's choices all equal its `n` = 1 answer.
async fn parallel_choices(stack: &Stack) {
    let cases = [
        ("/v1/chat/completions", chat(LONG, false)),
        ("/v1/completions", completion("Once upon a time", false)),
    ];
    for (path, body) in cases {
        let single =
            text_of(&serde_json::from_str(&stack.ok(&stack.agg, path, &body).await).unwrap());
        let mut body = body;
        body["n"] = json!(2);
        let expected = choice_texts(&stack.ok(&stack.agg, path, &body).await, false);
        assert_eq!(expected, vec![single; 2], "{path}");
        for stream in [false, true] {
            body["stream"] = json!(stream);
            let got = choice_texts(&stack.ok(&stack.gateway, path, &body).await, stream);
            assert_eq!(got, expected, "{path} n=2 stream={stream}");
        }
    }
}

/// SGLang's native `/generate` with a batch of prompts (one room per item), streamed
/// and not: each item's text equals the aggregated worker's.
async fn native_batch(stack: &Stack) {
    let body = json!({
        "text": ["Once upon a time", LONG],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    });
    let expected: Value =
        serde_json::from_str(&stack.ok(&stack.agg, "/generate", &body).await).unwrap();
    let texts = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap_or_else(|| panic!("not a batch answer: {v}"))
            .iter()
            .map(|item| item["text"].as_str().unwrap().to_string())
            .collect()
    };
    let expected = texts(&expected);
    assert_eq!(expected.len(), 2);
    let got: Value =
        serde_json::from_str(&stack.ok(&stack.gateway, "/generate", &body).await).unwrap();
    assert_eq!(texts(&got), expected);

    let mut body = body;
    body["stream"] = json!(true);
    let text = stack.ok(&stack.gateway, "/generate", &body).await;
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // SGLang streams each item's text so far, naming the item by `index`.
    let mut last = vec![String::new(); 2];
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(data).unwrap();
        assert!(event.get("error").is_none(), "{event}");
        let i = event["index"].as_u64().unwrap_or(0) as usize;
        last[i] = event["text"].as_str().unwrap().to_string();
    }
    assert_eq!(last, expected);
}

/// No pinned blocks, no published exports, no running requests, no open rooms.
async fn no_leaks(stack: &Stack, workers: &[&str]) {
    let started = Instant::now();
    for base in workers {
        loop {
            let pinned = stack.metric(base, "pdserve_kv_blocks_pinned").await;
            let published = stack
                .metric(base, "pdserve_kv_transfer_pinned_blocks")
                .await;
            let rooms = stack.metric(base, "pdserve_bootstrap_rooms_open").await;
            let running = stack.metric(base, "pdserve_num_requests_running").await;
            if pinned == 0.0 && published == 0.0 && rooms == 0.0 && running == 0.0 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{base}: {pinned} pinned, {published} published, {rooms} rooms, {running} running"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `pdserve up --protocol sglang`: the prefill worker gets a bootstrap port, the gateway
/// knows it, and requests (OpenAI and native) are served through the bootstrap handoff.
#[test]
fn up_runs_the_stack_in_sglang_mode() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let port = free_port();
    let mut up = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["up", "--protocol", "sglang", "--cores", "2"])
        .args(["--port", &port.to_string()])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut bootstrap_lines = Vec::new();
    loop {
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(line) => line,
            Err(e) => {
                let _ = up.kill();
                panic!("pdserve up did not come up: {e}");
            }
        };
        if line.contains("bootstrap port") {
            bootstrap_lines.push(line.clone());
        }
        if line.starts_with("Ctrl-C stops everything") {
            break;
        }
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let (instances, chat, generate) = rt.block_on(async {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let get = |path: &str| http.get(format!("{base}{path}")).send();
        let instances: Value = get("/instances").await.unwrap().json().await.unwrap();
        let post = |path: &str, body: Value| http.post(format!("{base}{path}")).json(&body).send();
        let chat = post("/v1/chat/completions", chat("Say hello.", true))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let generate: Value = post(
            "/generate",
            json!({"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
        (instances, chat, generate)
    });
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "up did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(bootstrap_lines.len(), 1, "{bootstrap_lines:?}");
    let prefill = instances["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["role"] == "prefill")
        .unwrap_or_else(|| panic!("no prefill worker in {instances}"))
        .clone();
    let bootstrap = prefill["bootstrap_port"]
        .as_u64()
        .expect("a bootstrap port");
    assert!(bootstrap_lines[0].ends_with(&format!("bootstrap port {bootstrap}")));
    assert!(!text_of(&sse_to_value(&chat)).is_empty(), "{chat}");
    assert!(!generate["text"].as_str().unwrap().is_empty(), "{generate}");
    assert!(status.success(), "{status}");
}
