//! Engine throughput through the scheduler (continuous batching, paged KV, sampling),
//! without HTTP: prefill tokens/s for a ~500-token prompt and decode tokens/s at several
//! batch sizes, plus peak RSS.
//!
//! `cargo run --release -p pdserve-engine --example engine_bench -- [--threads N] [--model PATH]`

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
            SeqEvent::Token { .. } if first.is_none() => first = Some(start.elapsed()),
            SeqEvent::Finished { .. } => break,
            SeqEvent::Failed(e) => panic!("request failed: {e}"),
            _ => {}
        }
    }
    (first.unwrap_or_default(), start.elapsed())
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
            format!(
                "item {} of list {salt} is a {} thing. ",
                i,
                ["red", "blue", "small", "warm"][i % 4]
            )
        })
        .take(len)
        .collect::<String>();
    let mut ids = model.tokenizer().encode(&text, false).expect("tokenize");
    ids.truncate(len);
    ids
}

fn decode_rate(
    engine: &EngineHandle,
    model: &Model,
    batch: usize,
    tokens: usize,
    salt: usize,
) -> f64 {
    let start = Instant::now();
    let mut rxs: Vec<_> = (0..batch)
        .map(|i| {
            engine
                .submit(request(prompt(model, 24, salt + i), tokens))
                .unwrap()
        })
        .collect();
    // Drain all concurrently so each first-token time is when it really arrived.
    let times: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = rxs
            .iter_mut()
            .map(|rx| s.spawn(move || drain(rx, start)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first_all = times.iter().map(|t| t.0).max().unwrap();
    let end = times.iter().map(|t| t.1).max().unwrap();
    // Tokens after every sequence's first, over the time after the last first token.
    (batch * (tokens - 1)) as f64 / (end - first_all).as_secs_f64()
}

fn main() {
    let threads: usize = arg("--threads").and_then(|t| t.parse().ok()).unwrap_or(2);
    pdserve_model::set_threads(threads);
    let path = arg("--model").map(Into::into).unwrap_or_else(|| {
        pdserve_model::ensure_default_model(&pdserve_model::home_dir()).expect("default model")
    });
    let model = Arc::new(Model::load(&path).expect("load model"));
    let runner = ModelRunner::new(model.clone(), 1024);
    let config = SchedulerConfig {
        max_num_seqs: 32,
        max_waiting: 1024,
        max_num_batched_tokens: 1024,
        max_model_len: 4096,
    };
    let (engine, thread) = scheduler::spawn(runner, config, Arc::new(Metrics::new())).unwrap();
    println!("model {} threads {threads}", path.display());

    // Warm-up (first-touch of weights and KV pages).
    let _ = drain(
        &mut engine.submit(request(prompt(&model, 64, 999), 4)).unwrap(),
        Instant::now(),
    );

    let mut prefill = Vec::new();
    for salt in 0..3 {
        let p = prompt(&model, 500, salt);
        let n = p.len();
        let start = Instant::now();
        let (ttft, _) = drain(&mut engine.submit(request(p, 1)).unwrap(), start);
        prefill.push(n as f64 / ttft.as_secs_f64());
    }
    prefill.sort_by(f64::total_cmp);
    println!(
        "prefill ~500-token prompt: {:.0} tok/s (median of 3)",
        prefill[1]
    );
    for (i, batch) in [1usize, 4, 8, 16].into_iter().enumerate() {
        let rate = decode_rate(&engine, &model, batch, 64, 100 + i * 100);
        println!("decode batch {batch:>2}: {rate:.0} tok/s");
    }
    println!("peak RSS: {:.0} MiB", peak_rss_mib());
    engine.shutdown();
    thread.join().unwrap();
}
