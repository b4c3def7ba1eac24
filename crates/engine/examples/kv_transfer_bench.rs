//! KV transfer against prefill: a prefill and a decode worker in this process, over real
//! HTTP and the real KV transfer service on 127.0.0.1. Each trial prefills a fresh
//! prompt on P (`do_remote_decode`), then has D pull its blocks (`do_remote_prefill`,
//! one token); reports prefill time, transfer bytes, time and MB/s, and the transfer's
//! share of the prefill time (target: at most 10%).
//!
//! `cargo run --release -p pdserve-engine --example kv_transfer_bench -- [--prompt-tokens N]
//! [--trials N] [--threads N] [--model PATH]`

use std::time::Instant;

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use serde_json::{json, Value};
use tokio::net::TcpListener;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

async fn start(role: &str, model: &str, threads: &str) -> (Worker, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let args = Cli::try_parse_from([
        "worker",
        "--role",
        role,
        "--model",
        model,
        "--threads",
        threads,
        "--num-kv-blocks",
        "1024",
    ])
    .expect("worker flags")
    .args;
    let worker = Worker::start(listener, args).await.expect("worker");
    let url = format!("http://{}", worker.local_addr());
    (worker, url)
}

async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> Value {
    let response = http.post(url).json(body).send().await.expect("request");
    let status = response.status();
    let value: Value = response.json().await.expect("JSON answer");
    assert!(status.is_success(), "{url}: {status} {value}");
    value
}

#[tokio::main]
async fn main() {
    let prompt_tokens: usize = arg("--prompt-tokens").map_or(1000, |v| v.parse().unwrap());
    let trials: usize = arg("--trials").map_or(3, |v| v.parse().unwrap());
    let threads = arg("--threads").unwrap_or_else(|| "1".into());
    let model = match arg("--model") {
        Some(m) => m,
        None => pdserve_model::ensure_default_model(&pdserve_model::home_dir())
            .expect("default model")
            .display()
            .to_string(),
    };
    let (prefill, p) = start("prefill", &model, &threads).await;
    let (decode, d) = start("decode", &model, &threads).await;
    let http = reqwest::Client::new();
    println!("prompt {prompt_tokens} tokens, {threads} compute thread(s) shared by P and D");
    let mut shares = Vec::new();
    for trial in 0..trials {
        // Fresh token ids per trial: no prefix-cache hit on P.
        let ids: Vec<u32> = (0..prompt_tokens)
            .map(|i| ((i * 7919 + trial * 104_729) % 30_000 + 1_000) as u32)
            .collect();
        let started = Instant::now();
        let answer = post(
            &http,
            &format!("{p}/v1/completions"),
            &json!({"prompt": ids, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
        let prefill_s = started.elapsed().as_secs_f64();
        let bytes0 = metric(&http, &d, "pdserve_kv_transfer_bytes_received_total").await;
        let secs0 = metric(&http, &d, "pdserve_kv_transfer_seconds_sum").await;
        post(
            &http,
            &format!("{d}/v1/completions"),
            &json!({"prompt": ids, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": answer["kv_transfer_params"]}),
        )
        .await;
        let mb =
            (metric(&http, &d, "pdserve_kv_transfer_bytes_received_total").await - bytes0) / 1e6;
        let transfer_s = metric(&http, &d, "pdserve_kv_transfer_seconds_sum").await - secs0;
        let share = 100.0 * transfer_s / prefill_s;
        shares.push(share);
        println!(
            "trial {trial}: prefill {:.0} ms ({:.0} tok/s); transfer {mb:.1} MB in {:.1} ms = \
             {:.0} MB/s; transfer/prefill {share:.2}%",
            prefill_s * 1e3,
            prompt_tokens as f64 / prefill_s,
            transfer_s * 1e3,
            mb / transfer_s,
        );
    }
    shares.sort_by(f64::total_cmp);
    println!(
        "median transfer/prefill: {:.2}% (target <= 10%)",
        shares[shares.len() / 2]
    );
    prefill.shutdown().await.expect("prefill shutdown");
    decode.shutdown().await.expect("decode shutdown");
}
