//! Gateway overhead benchmark: requests/s, p50/p99 latency and added latency of the
//! gateway against hitting a worker directly, plus the gateway process's peak RSS.
//!
//! A stub worker (the fastest answer a vLLM-shaped worker can give: precomputed bodies)
//! and each gateway run as separate processes (this binary re-executed with the `stub`
//! and `gateway` subcommands); this process generates the load.
//!
//! With `--epd` it also measures encoder disaggregation (E+PD and E+P+D) with requests
//! that carry one image, against a stub encoder, and prints the encoder stage's cost: the
//! E+PD (E+P+D) gateway's latency minus the aggregated (P/D) gateway's on text requests.
//!
//! ```text
//! cargo run --release -p pdserve-gateway --example gateway_overhead -- --secs 3 [--epd]
//! ```

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use clap::{Parser, Subcommand};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Measure the pdserve gateway's overhead against a stub worker")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Seconds of load per measurement.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Concurrency levels (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Tokens (stream chunks) per response.
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Also measure E+PD and E+P+D (one image per request, stub encoder).
    #[arg(long)]
    epd: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Internal: run a gateway (the flags of `pdserve gateway`).
    Gateway(Box<pdserve_gateway::GatewayArgs>),
    /// Internal: run the stub worker.
    Stub {
        /// Ports to serve on (comma-separated): a P/D gateway needs a prefill and a
        /// decode worker at different URLs.
        #[arg(long, value_delimiter = ',')]
        port: Vec<u16>,
        #[arg(long)]
        tokens: usize,
    },
}

fn main() {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    match cli.command {
        Some(Command::Gateway(args)) => {
            if let Err(e) = runtime.block_on(pdserve_gateway::run(*args)) {
                eprintln!("gateway: {e}");
                std::process::exit(1);
            }
        }
        Some(Command::Stub { port, tokens }) => runtime.block_on(stub(port, tokens)),
        None => runtime.block_on(drive(cli.secs, &cli.concurrency, cli.tokens, cli.epd)),
    }
}

/// Precomputed stub answers.
struct StubBodies {
    prefill: Bytes,
    encoder: Bytes,
    decode_json: Bytes,
    decode_stream: Vec<Bytes>,
}

async fn stub(ports: Vec<u16>, tokens: usize) {
    let kv = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [1, 2, 3], "remote_engine_id": "stub", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1});
    let full = |n: usize| {
        json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x".repeat(n)},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
            "kv_transfer_params": kv})
        .to_string()
    };
    let mut decode_stream = Vec::new();
    for i in 0..tokens {
        let mut chunk = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
            "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": null,
                         "finish_reason": if i + 1 == tokens { json!("length") } else { json!(null) }}]});
        if i + 1 == tokens {
            chunk["kv_transfer_params"] = kv.clone();
        }
        decode_stream.push(Bytes::from(format!("data: {chunk}\n\n")));
    }
    decode_stream.push(Bytes::from_static(b"data: [DONE]\n\n"));
    // What a vLLM encoder answers for a one-image sub-request.
    let encoder = json!({"id": "chatcmpl-e", "object": "chat.completion", "created": 1,
        "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                   "finish_reason": "length"}],
        "usage": {"prompt_tokens": 260, "completion_tokens": 0, "total_tokens": 260},
        "ec_transfer_params": {"e-hash": {"metadata": {"image_grid_thw": [[1, 16, 16]]},
            "item_indices": [0], "peer_host": "127.0.0.1", "peer_port": 7000,
            "size_bytes": 1_048_576}}});
    let bodies = Arc::new(StubBodies {
        prefill: Bytes::from(full(1)),
        encoder: Bytes::from(encoder.to_string()),
        decode_json: Bytes::from(full(tokens)),
        decode_stream,
    });
    let answer = move |body: Bytes| {
        let bodies = bodies.clone();
        async move { stub_answer(&bodies, &body) }
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .route("/health", get(|| async { "ok" }));
    let mut servers = Vec::new();
    for port in ports {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind stub port")
            .tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
        let app = app.clone();
        servers.push(tokio::spawn(async move {
            axum::serve(listener, app).await.expect("stub server")
        }));
    }
    for server in servers {
        server.await.expect("stub task");
    }
}

fn stub_answer(bodies: &StubBodies, request: &[u8]) -> Response {
    let has = |needle: &[u8]| request.windows(needle.len()).any(|w| w == needle);
    let json_response = |b: &Bytes| ([(header::CONTENT_TYPE, "application/json")], b.clone());
    if has(b"\"do_remote_decode\":true") {
        return json_response(&bodies.prefill).into_response();
    }
    // Only an encoder sub-request still carries the raw image: the gateway rewrote it
    // into `image_embeds` for the prefill/decode legs.
    if has(b"\"type\":\"image_url\"") {
        return json_response(&bodies.encoder).into_response();
    }
    if has(b"\"stream\":true") {
        let chunks: Vec<Result<Bytes, std::convert::Infallible>> =
            bodies.decode_stream.iter().cloned().map(Ok).collect();
        return (
            [(header::CONTENT_TYPE, "text/event-stream")],
            Body::from_stream(futures::stream::iter(chunks)),
        )
            .into_response();
    }
    json_response(&bodies.decode_json).into_response()
}

/// A child process killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Child {
    /// Peak resident set size (VmHWM) in KiB.
    fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

fn spawn_self(args: &[String]) -> Child {
    let exe = std::env::current_exe().expect("own path");
    Child(
        std::process::Command::new(exe)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn child"),
    )
}

async fn wait_ready(client: &reqwest::Client, url: &str) {
    for _ in 0..500 {
        if client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{url} did not come up");
}

/// One measurement's outcome.
struct Run {
    requests: usize,
    errors: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Run {
    fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i]
    }
}

async fn load(
    client: &reqwest::Client,
    url: &str,
    (stream, image): (bool, bool),
    conc: usize,
    secs: f64,
) -> Run {
    let content = if image {
        json!([{"type": "text", "text": "Say something."},
               {"type": "image_url", "image_url": {"url": "http://media.local/cat.png"}}])
    } else {
        json!("Say something.")
    };
    let body = Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": content}],
               "max_tokens": 16, "stream": stream})
        .to_string(),
    );
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (client, url, body) = (client.clone(), url.to_string(), body.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let ok = match client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body.clone())
                        .send()
                        .await
                    {
                        Ok(r) if r.status().is_success() => match r.bytes().await {
                            Ok(b) => !stream || b.ends_with(b"data: [DONE]\n\n"),
                            Err(_) => false,
                        },
                        _ => false,
                    };
                    if ok {
                        latencies.push(t.elapsed());
                    } else {
                        errors += 1;
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut run = Run {
        requests: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
    };
    for t in tasks {
        let (latencies, errors) = t.await.expect("load task");
        run.errors += errors;
        run.latencies.extend(latencies);
    }
    run.elapsed = start.elapsed();
    run.requests = run.latencies.len();
    run.latencies.sort();
    run
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn drive(secs: f64, concurrency: &[usize], tokens: usize, epd: bool) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("client");
    let stub_port = free_port();
    let prefill_port = free_port();
    let encoder_port = free_port();
    let _stub = spawn_self(&[
        "stub".into(),
        "--port".into(),
        format!("{stub_port},{prefill_port},{encoder_port}"),
        "--tokens".into(),
        tokens.to_string(),
    ]);
    let stub_url = format!("http://127.0.0.1:{stub_port}");
    let prefill_url = format!("http://127.0.0.1:{prefill_port}");
    let encoder_url = format!("http://127.0.0.1:{encoder_port}");
    wait_ready(&client, &format!("{stub_url}/health")).await;
    wait_ready(&client, &format!("{prefill_url}/health")).await;
    wait_ready(&client, &format!("{encoder_url}/health")).await;

    println!(
        "{} chunks per response, {secs} s per measurement, load generator and stub in separate processes",
        tokens
    );
    println!(
        "{:<14} {:>6} {:>5} {:>10} {:>9} {:>9} {:>12} {:>12} {:>7}",
        "target", "stream", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "errors"
    );
    let mut direct = Vec::new();
    for &stream in &[false, true] {
        for &conc in concurrency {
            let url = format!("{stub_url}/v1/chat/completions");
            load(&client, &url, (stream, false), conc, secs.min(1.0)).await; // warm-up
            let run = load(&client, &url, (stream, false), conc, secs).await;
            print_row("direct", stream, conc, &run, None);
            direct.push(((stream, conc), run));
        }
    }
    let mut setups = vec![("gateway agg", "agg"), ("gateway P/D", "pd")];
    if epd {
        setups.extend([("gateway E+PD", "e+pd"), ("gateway E+P+D", "e+p+d")]);
    }
    let mut measured: Vec<Measured> = Vec::new();
    for (label, mode) in setups {
        let port = free_port();
        let mut args: Vec<String> = vec!["gateway".into(), "--port".into(), port.to_string()];
        if mode.ends_with("p+d") || mode == "pd" {
            args.extend([
                "--prefill".into(),
                prefill_url.clone(),
                "--decode".into(),
                stub_url.clone(),
            ]);
        } else {
            args.extend(["--worker".into(), stub_url.clone()]);
        }
        let image = mode.starts_with("e+");
        if image {
            args.extend(["--encode".into(), encoder_url.clone()]);
        }
        let gateway = spawn_self(&args);
        let gateway_url = format!("http://127.0.0.1:{port}");
        wait_ready(&client, &format!("{gateway_url}/health")).await;
        let idle_rss = gateway.peak_rss_kib();
        for &stream in &[false, true] {
            for &conc in concurrency {
                let url = format!("{gateway_url}/v1/chat/completions");
                load(&client, &url, (stream, image), conc, secs.min(1.0)).await;
                let run = load(&client, &url, (stream, image), conc, secs).await;
                let base = direct
                    .iter()
                    .find(|(k, _)| *k == (stream, conc))
                    .map(|(_, r)| r);
                print_row(label, stream, conc, &run, base);
                measured.push((
                    (mode, stream, conc),
                    (ms(run.percentile(0.5)), ms(run.percentile(0.99))),
                ));
            }
        }
        println!(
            "{label}: gateway peak RSS (VmHWM) {:.1} MiB (after start-up: {:.1} MiB)",
            gateway.peak_rss_kib().unwrap_or(0) as f64 / 1024.0,
            idle_rss.unwrap_or(0) as f64 / 1024.0
        );
    }
    if epd {
        print_encoder_stage(&measured, concurrency);
    }
}

/// (setup, stream, concurrency) → (p50, p99) in ms, for the encoder stage's cost.
type Measured = ((&'static str, bool, usize), (f64, f64));

/// The encoder stage's cost: E+PD minus aggregated and E+P+D minus P/D (same stream
/// and concurrency), next to the P/D handoff's own cost (P/D minus aggregated).
fn print_encoder_stage(measured: &[Measured], concurrency: &[usize]) {
    let find = |mode: &str, stream: bool, conc: usize| {
        measured
            .iter()
            .find(|(k, _)| *k == (mode, stream, conc))
            .map(|(_, v)| *v)
    };
    println!(
        "{:<26} {:>6} {:>5} {:>12} {:>12}",
        "added stage", "stream", "conc", "+p50 ms", "+p99 ms"
    );
    for stream in [false, true] {
        for &conc in concurrency {
            for (label, with, without) in [
                ("encoder stage (E+PD)", "e+pd", "agg"),
                ("encoder stage (E+P+D)", "e+p+d", "pd"),
                ("P/D handoff (for scale)", "pd", "agg"),
            ] {
                if let (Some(a), Some(b)) = (find(with, stream, conc), find(without, stream, conc))
                {
                    println!(
                        "{:<26} {:>6} {:>5} {:>+12.3} {:>+12.3}",
                        label,
                        if stream { "yes" } else { "no" },
                        conc,
                        a.0 - b.0,
                        a.1 - b.1
                    );
                }
            }
        }
    }
}

fn print_row(label: &str, stream: bool, conc: usize, run: &Run, base: Option<&Run>) {
    let added = |p: f64| match base {
        Some(b) => format!("{:+.3}", ms(run.percentile(p)) - ms(b.percentile(p))),
        None => "-".into(),
    };
    println!(
        "{:<14} {:>6} {:>5} {:>10.0} {:>9.3} {:>9.3} {:>12} {:>12} {:>7}",
        label,
        if stream { "yes" } else { "no" },
        conc,
        run.requests as f64 / run.elapsed.as_secs_f64(),
        ms(run.percentile(0.5)),
        ms(run.percentile(0.99)),
        added(0.5),
        added(0.99),
        run.errors
    );
}
