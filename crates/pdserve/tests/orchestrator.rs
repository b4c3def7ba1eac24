//! Decode as orchestrator end to end, over real sockets on 127.0.0.1: decode workers
//! started with `--prefill` are the entry point, with no gateway. An aggregated worker is
//! the oracle; two real prefill workers serve a sequential and a concurrent
//! orchestrator; a scripted stand-in prefill worker (forwarding to a real one) drives
//! the failures; a real prefill process is killed mid-request.
//!
//! One test drives every scenario in turn: the workers load the model once, and the
//! final leak check sees the whole suite's traffic.

#[path = "support/http1.rs"]
mod http1;
#[path = "support/openai.rs"]
mod openai;
#[path = "support/prefill_stub.rs"]
mod prefill_stub;

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser;
use openai::{chat, completion, sse_to_value, text_of, wait_health, Process};
use pdserve_engine::{Worker, WorkerArgs};
use prefill_stub::{Mode, PrefillStub, REJECTION};
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// Bounds the whole suite, model loads included (2 slow CI cores).
const SUITE_DEADLINE: Duration = Duration::from_secs(900);
/// Unread KV is freed this long after it was published (shortened for the test).
const ABORT_TIMEOUT_SECS: &str = "4";
/// The stub orchestrator's prefill timeout.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(2);
/// What a failed prefill may take to reach the client at most.
const ERROR_BOUND: Duration = Duration::from_secs(6);
/// Longest wait for pre-warm to make an orchestrator healthy.
const WARM_BOUND: Duration = Duration::from_secs(30);

const LONG: &str = "The history of the printing press begins in the fifteenth century, when \
                    Johannes Gutenberg combined movable metal type with oil-based ink and a \
                    screw press. Explain in one sentence why this mattered";

const PREFILL_OK: &str = "pdserve_orchestrator_prefill_requests_total";
const TOKENIZED: &str = "pdserve_prompts_tokenized_total";

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

async fn start_worker(model: &Path, extra: &[&str]) -> (Worker, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut argv = vec![
        "worker".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--served-model-name".into(),
        "smollm2".into(),
        "--threads".into(),
        "1".into(),
        "--num-kv-blocks".into(),
        "256".into(),
        "--kv-abort-timeout".into(),
        ABORT_TIMEOUT_SECS.into(),
        "--prewarm-interval-secs".into(),
        "1".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = Cli::try_parse_from(argv).unwrap().args;
    let worker = Worker::start(listener, args).await.unwrap();
    let url = format!("http://{}", worker.local_addr());
    (worker, url)
}

struct Suite {
    http: reqwest::Client,
    agg: String,
    prefill: [String; 2],
    seq: String,
    conc: String,
    stubbed: String,
    stub: PrefillStub,
}

impl Suite {
    async fn post(&self, base: &str, path: &str, body: &Value) -> (u16, Value) {
        self.post_with(base, path, body, None).await
    }

    async fn post_with(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        session: Option<&str>,
    ) -> (u16, Value) {
        let (status, text) = self.post_raw(base, path, body, session).await;
        if body["stream"] == json!(true) && status == 200 {
            return (status, sse_to_value(&text));
        }
        let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, value)
    }

    async fn post_raw(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        session: Option<&str>,
    ) -> (u16, String) {
        let mut request = self.http.post(format!("{base}{path}")).json(body);
        if let Some(session) = session {
            request = request.header("x-session-id", session);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    }

    async fn ok(&self, base: &str, path: &str, body: &Value) -> Value {
        let (status, value) = self.post(base, path, body).await;
        assert_eq!(status, 200, "{base}{path}: {value}");
        value
    }

    /// The sum of the metric lines at `base` named `name` whose labels contain every one
    /// of `labels` (0 when there is none).
    async fn metric(&self, base: &str, name: &str, labels: &[&str]) -> f64 {
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
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter(|l| labels.iter().all(|label| l.contains(label)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn tokenized_on_prefill(&self) -> f64 {
        self.metric(&self.prefill[0], TOKENIZED, &[]).await
            + self.metric(&self.prefill[1], TOKENIZED, &[]).await
    }

    /// Successful prefill legs `orchestrator` sent to each real prefill worker.
    async fn prefills_by_worker(&self, orchestrator: &str) -> [f64; 2] {
        let mut out = [0.0; 2];
        for (i, p) in self.prefill.iter().enumerate() {
            let label = format!("prefill=\"{p}\"");
            out[i] = self
                .metric(orchestrator, PREFILL_OK, &[&label, "outcome=\"ok\""])
                .await;
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_as_orchestrator_matches_aggregated_and_fails_cleanly() {
    tokio::time::timeout(SUITE_DEADLINE, suite())
        .await
        .expect("the orchestrator suite ran past its deadline");
}

async fn suite() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let (agg_worker, agg) = start_worker(&model, &["--role", "both"]).await;
    let (p0_worker, p0) = start_worker(&model, &["--role", "prefill"]).await;
    let (p1_worker, p1) = start_worker(&model, &["--role", "prefill"]).await;
    let both = format!("{p0},{p1}");
    let decode = ["--role", "decode", "--prefill", &both];
    let (seq_worker, seq) = start_worker(&model, &decode).await;
    let concurrent = [&decode[..], &["--handoff", "concurrent"]].concat();
    let (conc_worker, conc) = start_worker(&model, &concurrent).await;

    // Pre-warm gates /health: the stand-in prefill worker is not listening yet.
    let stub_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let stub_url = format!("http://127.0.0.1:{stub_port}");
    let timeout = PREFILL_TIMEOUT.as_secs().to_string();
    let (stubbed_worker, stubbed) = start_worker(
        &model,
        &[
            "--role",
            "decode",
            "--prefill",
            &stub_url,
            "--handoff",
            "concurrent",
            "--prefill-timeout-secs",
            &timeout,
        ],
    )
    .await;
    let unwarmed = wait_health(&http, &stubbed, 503, WARM_BOUND).await;
    assert_eq!(unwarmed["reason"], "prefill_not_warm", "{unwarmed}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let still = wait_health(&http, &stubbed, 503, WARM_BOUND).await;
    assert_eq!(still["reason"], "prefill_not_warm", "{still}");
    let listener = TcpListener::bind(("127.0.0.1", stub_port)).await.unwrap();
    let stub = PrefillStub::start(listener, p0.clone(), Mode::Proxy);
    wait_health(&http, &stubbed, 200, WARM_BOUND).await;
    for d in [&seq, &conc] {
        wait_health(&http, d, 200, WARM_BOUND).await;
    }

    let suite = Suite {
        http,
        agg,
        prefill: [p0, p1],
        seq,
        conc,
        stubbed,
        stub,
    };
    let failed_prewarms = suite
        .metric(
            &suite.stubbed,
            "pdserve_orchestrator_prewarms_total",
            &["failed"],
        )
        .await;
    assert!(
        failed_prewarms >= 1.0,
        "the first pre-warms must have failed"
    );

    oracle(&suite).await;
    first_token_from_prefill(&suite).await;
    cached_tokens(&suite).await;
    session_affinity(&suite).await;
    prefill_errors(&suite).await;
    aborted_stream(&suite).await;
    killed_prefill_process(&suite, &model).await;
    no_leaks(&suite).await;

    for worker in [
        agg_worker,
        p0_worker,
        p1_worker,
        seq_worker,
        conc_worker,
        stubbed_worker,
    ] {
        worker.shutdown().await.unwrap();
    }
}

/// Chat and completions, streamed and not, through the sequential and the concurrent
/// orchestrator: the aggregated worker's text, token for token; the prompt is tokenized
/// once, on the orchestrator, never on a prefill worker.
async fn oracle(s: &Suite) {
    let cases = [
        ("/v1/chat/completions", chat("Hi", false)),
        ("/v1/chat/completions", chat(LONG, false)),
        ("/v1/completions", completion("Hello", false)),
        ("/v1/completions", completion(LONG, false)),
    ];
    let mut expected = Vec::new();
    for (path, body) in &cases {
        let text = text_of(&s.ok(&s.agg, path, body).await);
        assert!(!text.is_empty(), "{path} {body}");
        expected.push(text);
    }
    let mut logprobs = completion(LONG, false);
    logprobs["logprobs"] = json!(0);
    logprobs["ignore_eos"] = json!(true);
    let tokens = |v: Value| v["choices"][0]["logprobs"]["tokens"].clone();
    let expected_tokens = tokens(s.ok(&s.agg, "/v1/completions", &logprobs).await);
    assert_eq!(expected_tokens.as_array().map(Vec::len), Some(12));

    for d in [&s.seq, &s.conc] {
        let tokenized = s.metric(d, TOKENIZED, &[]).await;
        let tokenized_on_prefill = s.tokenized_on_prefill().await;
        let prefills = s.metric(d, PREFILL_OK, &["outcome=\"ok\""]).await;
        let mut sent = 0.0;
        for ((path, body), expected) in cases.iter().zip(&expected) {
            for stream in [false, true] {
                let mut body = body.clone();
                body["stream"] = json!(stream);
                let got = s.ok(d, path, &body).await;
                assert_eq!(&text_of(&got), expected, "{d}{path} stream={stream}");
                sent += 1.0;
            }
        }
        let got = tokens(s.ok(d, "/v1/completions", &logprobs).await);
        assert_eq!(got, expected_tokens, "{d}: token for token");
        sent += 1.0;
        assert_eq!(s.metric(d, TOKENIZED, &[]).await - tokenized, sent, "{d}");
        assert_eq!(
            s.tokenized_on_prefill().await,
            tokenized_on_prefill,
            "prefill workers got token ids"
        );
        let legs = s.metric(d, PREFILL_OK, &["outcome=\"ok\""]).await - prefills;
        assert_eq!(legs, sent, "{d}: one prefill leg per request");
        let imported = s
            .metric(d, "pdserve_kv_transfer_imported_tokens_total", &[])
            .await;
        assert!(imported > 100.0, "{d} imported only {imported} tokens");
    }
    let fallbacks = s
        .metric(
            &s.conc,
            "pdserve_orchestrator_concurrent_fallbacks_total",
            &[],
        )
        .await;
    assert_eq!(fallbacks, 0.0, "every concurrent read got its blocks early");
}

/// The decode starts from the prefill leg's own first token (on by default): seeded
/// sampling with `n` = 2, streamed and not, gives the aggregated worker's tokens, ids
/// and usage; a request that turns it off gets the same, sampled here.
async fn first_token_from_prefill(s: &Suite) {
    const FIRST: &str = "pdserve_orchestrator_first_token_from_prefill_total";
    let mut sampled = completion(LONG, false);
    for (field, value) in [
        ("temperature", json!(0.8)),
        ("seed", json!(5)),
        ("n", json!(2)),
        ("ignore_eos", json!(true)),
        ("return_token_ids", json!(true)),
    ] {
        sampled[field] = value;
    }
    let mut streamed = completion(LONG, true);
    streamed["temperature"] = json!(0.7);
    streamed["seed"] = json!(9);
    let choices = |v: &Value| {
        let mut list = v["choices"].as_array().unwrap().clone();
        list.sort_by_key(|c| c["index"].as_u64());
        list.iter()
            .map(|c| (c["text"].clone(), c["token_ids"].clone()))
            .collect::<Vec<_>>()
    };
    let counts = |v: &Value| {
        let u = &v["usage"];
        (u["prompt_tokens"].clone(), u["completion_tokens"].clone())
    };
    let expected = s.ok(&s.agg, "/v1/completions", &sampled).await;
    let listed = choices(&expected);
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].1.as_array().map(Vec::len), Some(12), "{expected}");
    let expected_stream = text_of(&s.ok(&s.agg, "/v1/completions", &streamed).await);

    for d in [&s.seq, &s.conc] {
        let used = s.metric(d, FIRST, &["outcome=\"used\""]).await;
        let asked = s.metric(d, FIRST, &[]).await;
        let got = s.ok(d, "/v1/completions", &sampled).await;
        assert_eq!(choices(&got), listed, "{d}: seeded, n = 2");
        assert_eq!(counts(&got), counts(&expected), "{d}: usage");
        let got = s.ok(d, "/v1/completions", &streamed).await;
        assert_eq!(text_of(&got), expected_stream, "{d}: seeded stream");
        assert_eq!(
            s.metric(d, FIRST, &["outcome=\"used\""]).await - used,
            2.0,
            "{d}: both started from the prefill's token"
        );
        let mut off = sampled.clone();
        off["first_token_from_prefill"] = json!(false);
        let got = s.ok(d, "/v1/completions", &off).await;
        assert_eq!(choices(&got), listed, "{d}: sampled here");
        assert_eq!(s.metric(d, FIRST, &[]).await - asked, 2.0, "{d}: not asked");
    }

    let mut bad = completion("Hi", false);
    bad["first_token_from_prefill"] = json!("yes");
    let (status, body) = s.post(&s.seq, "/v1/completions", &bad).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "first_token_from_prefill");
    let mut chat_ids = chat("Hi", false);
    chat_ids["return_token_ids"] = json!(true);
    let answer = s.ok(&s.agg, "/v1/chat/completions", &chat_ids).await;
    assert_eq!(
        answer["choices"][0]["token_ids"].as_array().map(Vec::len),
        answer["usage"]["completion_tokens"]
            .as_u64()
            .map(|n| n as usize),
        "{answer}"
    );
    let mut streamed_ids = completion("Hi", true);
    streamed_ids["return_token_ids"] = json!(true);
    let (status, body) = s.post(&s.agg, "/v1/completions", &streamed_ids).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "return_token_ids");
}

/// A prompt sent twice in one session (so to one prefill worker): the second time the
/// prefill worker finds it in its prefix cache, and the orchestrator's usage counts those
/// tokens as cached, as the aggregated worker does. The first time nothing is cached.
async fn cached_tokens(s: &Suite) {
    let path = "/v1/completions";
    let cached = |v: Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
    };
    for (d, name) in [(&s.seq, "sequential"), (&s.conc, "concurrent")] {
        let mut body = completion(
            // Unique from its first token: the prefill workers have seen LONG already.
            &format!("The {name} orchestrator hears this: {LONG}"),
            false,
        );
        body["user"] = json!("cached-tokens");
        s.ok(&s.agg, path, &body).await;
        let expected = cached(s.ok(&s.agg, path, &body).await);
        assert!(
            expected >= 16,
            "the aggregated worker hit {expected} tokens"
        );
        let cold = cached(s.ok(d, path, &body).await);
        let warm = cached(s.ok(d, path, &body).await);
        assert_eq!(cold, 0, "{d}: a cold prompt");
        assert_eq!(
            warm, expected,
            "{d} reports the prefill worker's prefix-cache hits"
        );
    }
}

/// A session (`X-Session-Id`, `user` or `conversation_id`) stays on one prefill worker;
/// requests without one alternate.
async fn session_affinity(s: &Suite) {
    let path = "/v1/completions";
    let mut body = completion("Hello", false);
    body["max_tokens"] = json!(2);
    let sessions: [(&str, Option<&str>, Value); 3] = [
        ("header", Some("alice"), body.clone()),
        ("user", None, {
            let mut b = body.clone();
            b["user"] = json!("bob");
            b
        }),
        ("conversation_id", None, {
            let mut b = body.clone();
            b["conversation_id"] = json!("conversation-7");
            b
        }),
    ];
    for (what, header, body) in &sessions {
        let before = s.prefills_by_worker(&s.seq).await;
        for _ in 0..4 {
            let (status, answer) = s.post_with(&s.seq, path, body, *header).await;
            assert_eq!(status, 200, "{answer}");
        }
        let after = s.prefills_by_worker(&s.seq).await;
        let moved = [after[0] - before[0], after[1] - before[1]];
        assert!(
            moved == [4.0, 0.0] || moved == [0.0, 4.0],
            "{what}: the session was spread over the prefill workers: {moved:?}"
        );
    }
    let before = s.prefills_by_worker(&s.seq).await;
    for _ in 0..4 {
        s.ok(&s.seq, path, &body).await;
    }
    let after = s.prefills_by_worker(&s.seq).await;
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [2.0, 2.0],
        "round-robin without a session"
    );
}

/// Through the stand-in prefill worker (concurrent handoff): a 4xx comes back unchanged,
/// a 5xx as 502, silence as 504 after --prefill-timeout-secs, a connection dropped
/// after the KV was published as an error, never as a successful answer.
async fn prefill_errors(s: &Suite) {
    let path = "/v1/completions";
    for stream in [false, true] {
        s.stub.set(Mode::Reject);
        let (status, body) = s
            .post_raw(&s.stubbed, path, &completion("Hello", stream), None)
            .await;
        assert_eq!((status, body.as_str()), (400, REJECTION), "stream={stream}");

        s.stub.set(Mode::Fail);
        let (status, err) = s.post(&s.stubbed, path, &completion("Hello", stream)).await;
        assert_eq!(status, 502, "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("500") && message.contains("exploded"),
            "{err}"
        );

        s.stub.set(Mode::Hang);
        let started = Instant::now();
        let (status, err) = s.post(&s.stubbed, path, &completion("Hello", stream)).await;
        assert_eq!(status, 504, "{err}");
        assert!(started.elapsed() >= PREFILL_TIMEOUT && started.elapsed() < ERROR_BOUND);

        // The real prefill worker computes and publishes; its answer never arrives.
        s.stub.set(Mode::Drop);
        let started = Instant::now();
        let (status, body) = s
            .post_raw(&s.stubbed, path, &completion(LONG, stream), None)
            .await;
        assert!(started.elapsed() < ERROR_BOUND, "too slow");
        let errored = status == 502 || (status == 200 && stream && body.contains("\"error\""));
        assert!(errored, "a dropped prefill leg must fail: {status} {body}");
    }
    s.stub.set(Mode::Proxy);
    let body = chat(LONG, true);
    let expected = text_of(
        &s.ok(&s.agg, "/v1/chat/completions", &chat(LONG, false))
            .await,
    );
    let started = Instant::now();
    loop {
        // The stand-in went cold on the dropped connections; it is warm again shortly.
        let (status, got) = s.post(&s.stubbed, "/v1/chat/completions", &body).await;
        if status == 200 {
            assert_eq!(text_of(&got), expected);
            break;
        }
        assert!(started.elapsed() < WARM_BOUND, "{status} {got}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A prefill worker that ignores publish_request_id: the early read finds nothing,
    // the KV is read by the answer's params instead (same output), and the worker gets
    // sequential handoff from then on (no second fallback).
    s.stub.set(Mode::ProxyWithoutPublishId);
    let fallbacks = "pdserve_orchestrator_concurrent_fallbacks_total";
    let before = s.metric(&s.stubbed, fallbacks, &[]).await;
    for _ in 0..2 {
        let got = s.ok(&s.stubbed, "/v1/chat/completions", &body).await;
        assert_eq!(text_of(&got), expected);
    }
    assert_eq!(s.metric(&s.stubbed, fallbacks, &[]).await - before, 1.0);

    // A prefill worker that does not know return_token_ids: its answer lists no token
    // id, so the first token is sampled here, with the same output.
    s.stub.set(Mode::ProxyWithoutTokenIds);
    let first = "pdserve_orchestrator_first_token_from_prefill_total";
    let missing = s.metric(&s.stubbed, first, &["outcome=\"missing\""]).await;
    let got = s.ok(&s.stubbed, "/v1/chat/completions", &body).await;
    assert_eq!(text_of(&got), expected);
    assert_eq!(
        s.metric(&s.stubbed, first, &["outcome=\"missing\""]).await - missing,
        1.0
    );
    s.stub.set(Mode::Proxy);
}

/// A client that drops a concurrent stream mid-way aborts both legs.
async fn aborted_stream(s: &Suite) {
    let mut body = chat(LONG, true);
    body["max_tokens"] = json!(200);
    body["ignore_eos"] = json!(true);
    let mut response = s
        .http
        .post(format!("{}/v1/chat/completions", s.conc))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.chunk().await.unwrap().is_some());
    drop(response);
}

/// A real prefill process killed while it computes a long prompt: the concurrent
/// orchestrator's client gets an error in bounded time, and the orchestrator keeps
/// nothing pinned or running.
async fn killed_prefill_process(s: &Suite, model: &Path) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let mut prefill = Process::spawn(&[
        "--log",
        "warn",
        "worker",
        "--role",
        "prefill",
        "--port",
        &port.to_string(),
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        "smollm2",
        "--threads",
        "1",
        "--num-kv-blocks",
        "256",
    ]);
    prefill.wait_healthy(&s.http, &url).await;
    let (orchestrator, base) = start_worker(
        model,
        &[
            "--role",
            "decode",
            "--prefill",
            &url,
            "--handoff",
            "concurrent",
        ],
    )
    .await;
    wait_health(&s.http, &base, 200, WARM_BOUND).await;

    // Long enough that its prefill takes several scheduler steps.
    let prompt = "one two three four five six seven eight nine ten ".repeat(300);
    let mut body = completion(&prompt, false);
    body["max_tokens"] = json!(4);
    let request = {
        let http = s.http.clone();
        let base = base.clone();
        tokio::spawn(async move {
            let response = http
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        })
    };
    // Kill it once it is computing the prompt (admitted: its prompt tokens are counted).
    let started = Instant::now();
    while s.metric(&url, "pdserve_prompt_tokens_total", &[]).await < 1000.0 {
        if request.is_finished() {
            panic!("answered before the kill: {:?}", request.await.unwrap());
        }
        assert!(started.elapsed() < ERROR_BOUND, "the prefill never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    prefill.kill();
    let killed = Instant::now();
    let (status, body) = tokio::time::timeout(ERROR_BOUND, request)
        .await
        .expect("the client waited too long for the error")
        .unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains(&url),
        "the error names the prefill worker: {body}"
    );
    assert!(killed.elapsed() < ERROR_BOUND);
    settle_clean(s, &base, Duration::from_secs(5)).await;
    orchestrator.shutdown().await.unwrap();
}

/// After everything above (and the abort timeout), no worker holds a pinned block.
async fn no_leaks(s: &Suite) {
    let limit = Duration::from_secs(ABORT_TIMEOUT_SECS.parse::<u64>().unwrap() + 10);
    for base in [
        &s.agg,
        &s.prefill[0],
        &s.prefill[1],
        &s.seq,
        &s.conc,
        &s.stubbed,
    ] {
        settle_clean(s, base, limit).await;
    }
}

async fn settle_clean(s: &Suite, base: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        let pinned = s.metric(base, "pdserve_kv_blocks_pinned", &[]).await;
        let published = s
            .metric(base, "pdserve_kv_transfer_pinned_blocks", &[])
            .await;
        let running = s.metric(base, "pdserve_num_requests_running", &[]).await;
        if pinned == 0.0 && published == 0.0 && running == 0.0 {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{base}: {pinned} blocks pinned, {published} published, {running} running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
