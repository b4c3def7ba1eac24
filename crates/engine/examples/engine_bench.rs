//! Engine throughput through the scheduler (continuous batching, paged KV, sampling),
//! without HTTP: prefill tokens/s for a ~500-token prompt, decode tokens/s (32 steps) at
//! several batch sizes after 64-token prompts and at batch 1 after a 500-token prompt
//! (attention over ~500-530 positions), plus peak RSS.
//!
//! `cargo run --release -p pdserve-engine --example engine_bench -- [--threads N] [--model PATH]
//! [--max-num-batched-tokens N]`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_engine::metrics::Metrics;
use pdserve_engine::request::{GenerationRequest, SeqEvent, SeqEvents};
use pdserve_engine::scheduler::{self, EngineHandle, SchedulerConfig};
use pdserve_engine::step_model::ModelRunner;
use pdserve_model::Model;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn request(prompt: Vec<u32>, max_new_tokens: usize) -> GenerationRequest {
    // Greedy with EOS ignored: every request generates exactly `max_new_tokens`.
    GenerationRequest::new(prompt, max_new_tokens)
}

/// Waits for the first token, then the end; returns (time to first token, time to end).
fn drain(rx: &mut SeqEvents, start: Instant) -> (Duration, Duration) {
    let mut first = None;
    while let Some(event) = rx.blocking_recv() {
        match event {
            SeqEvent::Token { .. } if first.is_none() => {
                first = Some(start.elapsed());
                FIRST_TOKENS.fetch_add(1, Ordering::SeqCst);
            }
            SeqEvent::Finished { .. } => break,
            SeqEvent::Failed(e) => panic!("request failed: {e}"),
            _ => {}
        }
    }
    (first.unwrap_or_default(), start.elapsed())
}

/// CPU seconds this process has used (user + system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit(')').next().unwrap_or("");
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Kernel clock ticks are 100 Hz on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// Prints a rate per wall second and per `threads` CPU seconds used, so runs on a busy
/// machine (other processes taking the cores) stay comparable.
fn report(label: &str, tokens: usize, wall: Duration, cpu: f64, threads: usize) {
    let per_cpu = if cpu > 0.0 {
        tokens as f64 / (cpu / threads as f64)
    } else {
        0.0
    };
    println!(
        "{label}: {:.0} tok/s wall, {per_cpu:.0} tok/s per {threads} CPU-seconds",
        tokens as f64 / wall.as_secs_f64()
    );
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// A distinct prompt of `len` tokens (distinct so the prefix cache never helps).
fn prompt(model: &Model, len: usize, salt: usize) -> Vec<u32> {
    let text = (0..)
        .map(|i| {
            let colour = ["red", "blue", "small", "warm"][i % 4];
            format!("item {i} of list {salt} is a {colour} thing. ")
        })
        .take(len)
        .collect::<String>();
    let mut ids = model.tokenizer().encode(&text, false).expect("tokenize");
    ids.truncate(len);
    ids
}

/// Runs `batch` requests of `prompt_len`-token prompts and `tokens` new tokens each at
/// once; decode time is measured from the moment every sequence has its first token
/// (prefills done) to the end.
#[allow(clippy::too_many_arguments)]
fn decode(
    engine: &EngineHandle,
    model: &Model,
    label: &str,
    batch: usize,
    prompt_len: usize,
    tokens: usize,
    salt: usize,
    threads: usize,
) {
    let start = Instant::now();
    let mut rxs: Vec<_> = (0..batch)
        .map(|i| {
            engine
                .submit(request(prompt(model, prompt_len, salt + i), tokens))
                .unwrap()
        })
        .collect();
    // Drain concurrently so each first-token time is when it really arrived.
    let (times, cpu_after_prefill) = std::thread::scope(|s| {
        let handles: Vec<_> = rxs
            .iter_mut()
            .map(|rx| s.spawn(move || drain(rx, start)))
            .collect();
        // CPU time is sampled once every sequence has its first token (polled).
        while FIRST_TOKENS.load(Ordering::SeqCst) < batch {
            std::thread::sleep(Duration::from_millis(1));
        }
        let cpu_after_prefill = cpu_seconds();
        let times: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (times, cpu_after_prefill)
    });
    let first_all = times.iter().map(|t| t.0).max().unwrap();
    let end = times.iter().map(|t| t.1).max().unwrap();
    let cpu = cpu_seconds() - cpu_after_prefill;
    report(label, batch * (tokens - 1), end - first_all, cpu, threads);
}

/// Prompt tokens per sequence for the decode runs (context 64, as llama.cpp's bench).
const DECODE_PROMPT: usize = 64;
/// Decode steps timed per sequence.
const DECODE_STEPS: usize = 32;

/// Sequences of the current phase that have their first token.
static FIRST_TOKENS: AtomicUsize = AtomicUsize::new(0);

fn main() {
    let threads: usize = arg("--threads").and_then(|t| t.parse().ok()).unwrap_or(2);
    pdserve_model::set_threads(threads);
    let path = arg("--model").map(Into::into).unwrap_or_else(|| {
        pdserve_model::ensure_default_model(&pdserve_model::home_dir()).expect("default model")
    });
    let model = Arc::new(Model::load(&path).expect("load model"));
    let runner = ModelRunner::new(model.clone(), 1024);
    let config = SchedulerConfig {
        policy: scheduler::SchedulingPolicy::Fcfs,
        max_num_seqs: 32,
        max_waiting: 1024,
        max_num_batched_tokens: arg("--max-num-batched-tokens")
            .and_then(|t| t.parse().ok())
            .unwrap_or(1024),
        max_model_len: 4096,
    };
    let (engine, thread) = scheduler::spawn(runner, config, Arc::new(Metrics::new())).unwrap();
    println!("model {} threads {threads}", path.display());

    // Warm-up (first touch of weights and KV pages).
    let warm = request(prompt(&model, 64, 999), 4);
    let _ = drain(&mut engine.submit(warm).unwrap(), Instant::now());

    for salt in 0..3 {
        let p = prompt(&model, 500, salt);
        let n = p.len();
        let cpu = cpu_seconds();
        let start = Instant::now();
        let (ttft, _) = drain(&mut engine.submit(request(p, 1)).unwrap(), start);
        report(
            &format!("prefill {n}-token prompt"),
            n,
            ttft,
            cpu_seconds() - cpu,
            threads,
        );
    }
    // The shape of scripts/llamacpp_bench.py: 64-token prompts (500 for the long
    // context), then 32 decode steps per sequence (the first token comes from prefill).
    for (i, batch) in [1usize, 4, 8, 16].into_iter().enumerate() {
        FIRST_TOKENS.store(0, Ordering::SeqCst);
        let label = format!("decode batch {batch:>2} after 64-token prompts");
        decode(
            &engine,
            &model,
            &label,
            batch,
            DECODE_PROMPT,
            DECODE_STEPS + 1,
            100 + i * 100,
            threads,
        );
    }
    FIRST_TOKENS.store(0, Ordering::SeqCst);
    decode(
        &engine,
        &model,
        "decode batch  1 after a 500-token prompt",
        1,
        500,
        DECODE_STEPS + 1,
        900,
        threads,
    );
    println!("peak RSS: {:.0} MiB", peak_rss_mib());
    engine.shutdown();
    thread.join().unwrap();
}
