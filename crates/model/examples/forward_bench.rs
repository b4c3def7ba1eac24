//! Forward-pass throughput of our model against candle-transformers' `quantized_llama`.
//!
//! `cargo run --release -p pdserve-model --example forward_bench [-- [--ours-only] THREADS [WEIGHTS [DENSE_MIN_ROWS]]]`
//! (defaults: 2 threads and the default [`LoadOptions`]; WEIGHTS is `native`, `q8_0`,
//! `as-shipped` or `f32`; DENSE_MIN_ROWS a number or `none`). Prints prefill tokens/s for a ~500-token prompt, decode tokens/s
//! at batch 1, 4, 8 and 16, and peak RSS, then the same for candle's reference (prefill
//! and batch-1 decode; it has no batched KV cache).

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use pdserve_model::{
    ensure_default_model, home_dir, set_threads, KvStore, LoadOptions, Model, SequenceStep,
    WeightFormat, BLOCK_SIZE,
};

const PROMPT_TOKENS: usize = 500;
const DECODE_STEPS: usize = 32;
const DECODE_PROMPT: usize = 64;

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// CPU seconds used by this process so far (all threads, user + system).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Throughput by wall clock, and by CPU time spread over `threads` (what an idle machine
/// would give if nothing else competed for the cores; the shared build machine is noisy).
#[derive(Clone, Copy)]
struct Rate {
    wall: f64,
    cpu: f64,
}

impl Rate {
    fn measure(tokens: usize, threads: usize, f: impl FnOnce()) -> Self {
        let (t, c) = (Instant::now(), cpu_seconds());
        f();
        let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - c);
        Rate {
            wall: tokens as f64 / wall,
            cpu: tokens as f64 / (cpu / threads as f64),
        }
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} ({:.1})", self.wall, self.cpu)
    }
}

fn long_prompt(model: &Model) -> Vec<u32> {
    let text = "The history of the city begins with a small settlement by the river, where \
                traders met to exchange grain, salt and cloth. Over the centuries it grew into \
                a market town, then a centre of learning with libraries and workshops. ";
    let mut ids = Vec::new();
    while ids.len() < PROMPT_TOKENS {
        ids.extend(model.tokenizer().encode(text, false).unwrap());
    }
    ids.truncate(PROMPT_TOKENS);
    ids
}

/// Prefill rate, decode rates by batch size, and the batch-1 decode rate right after the
/// long prompt (attention over ~500 positions).
fn bench_ours(model: &Model, prompt: &[u32], threads: usize) -> (Rate, Vec<(usize, Rate)>, Rate) {
    let table: Vec<u32> =
        (0..(prompt.len() + DECODE_STEPS + 1).div_ceil(BLOCK_SIZE) as u32).collect();
    let mut kv = KvStore::new(model.config(), table.len());
    // Warm-up (allocations, thread pools), then the timed prefill.
    model
        .forward(
            &mut kv,
            &[SequenceStep {
                tokens: &prompt[..32],
                start_pos: 0,
                block_table: &table,
            }],
        )
        .unwrap();
    let prefill = Rate::measure(prompt.len(), threads, || {
        let step = SequenceStep {
            tokens: prompt,
            start_pos: 0,
            block_table: &table,
        };
        model.forward(&mut kv, &[step]).unwrap();
    });
    let mut next = 0u32;
    let long_decode = Rate::measure(DECODE_STEPS, threads, || {
        for step in 0..DECODE_STEPS {
            let step = SequenceStep {
                tokens: std::slice::from_ref(&next),
                start_pos: prompt.len() + step,
                block_table: &table,
            };
            next = argmax(&model.forward(&mut kv, &[step]).unwrap()[0]);
        }
    });

    let mut decode = Vec::new();
    for batch in [1usize, 4, 8, 16] {
        let per_seq = (DECODE_PROMPT + DECODE_STEPS + 1).div_ceil(BLOCK_SIZE);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let mut kv = KvStore::new(model.config(), batch * per_seq);
        let steps: Vec<SequenceStep> = tables
            .iter()
            .enumerate()
            .map(|(s, t)| SequenceStep {
                tokens: &prompt[s..s + DECODE_PROMPT],
                start_pos: 0,
                block_table: t,
            })
            .collect();
        model.forward(&mut kv, &steps).unwrap();
        let mut next: Vec<u32> = vec![0; batch];
        let rate = Rate::measure(batch * DECODE_STEPS, threads, || {
            for step in 0..DECODE_STEPS {
                let steps: Vec<SequenceStep> = (0..batch)
                    .map(|s| SequenceStep {
                        tokens: std::slice::from_ref(&next[s]),
                        start_pos: DECODE_PROMPT + step,
                        block_table: &tables[s],
                    })
                    .collect();
                let logits = model.forward(&mut kv, &steps).unwrap();
                next = logits.iter().map(|l| argmax(l)).collect();
            }
        });
        decode.push((batch, rate));
    }
    (prefill, decode, long_decode)
}

fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
        .0 as u32
}

fn bench_candle(path: &std::path::Path, prompt: &[u32], threads: usize) -> (Rate, Rate) {
    let dev = Device::Cpu;
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut weights = ModelWeights::from_gguf(content, &mut file, &dev).unwrap();
    let input = |ids: &[u32]| Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
    weights.forward(&input(&prompt[..32]), 0).unwrap();
    weights.clear_kv_cache();
    let prefill = Rate::measure(prompt.len(), threads, || {
        weights.forward(&input(prompt), 0).unwrap();
    });
    weights.clear_kv_cache();
    weights
        .forward(&input(&prompt[..DECODE_PROMPT]), 0)
        .unwrap();
    let mut next = 0u32;
    let decode = Rate::measure(DECODE_STEPS, threads, || {
        for step in 0..DECODE_STEPS {
            let logits = weights
                .forward(&input(&[next]), DECODE_PROMPT + step)
                .unwrap();
            next = argmax(&logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
        }
    });
    (prefill, decode)
}

const USAGE: &str = "usage: forward_bench [--ours-only] [THREADS [WEIGHTS [DENSE_MIN_ROWS]]]
  THREADS         worker threads (default 2)
  WEIGHTS         native (default) | q8_0 | as-shipped | f32
  DENSE_MIN_ROWS  a number, or none (default)
  --ours-only     skip candle-transformers' reference (its Q4_1 path is slow)";

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    let ours_only = args.iter().any(|a| a == "--ours-only");
    args.retain(|a| a != "--ours-only");
    let threads: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2);
    set_threads(threads);
    let mut options = LoadOptions::default();
    if let Some(w) = args.get(1) {
        options.weights = match w.as_str() {
            "native" => WeightFormat::Native,
            "q8_0" => WeightFormat::Q8_0,
            "as-shipped" => WeightFormat::AsShipped,
            "f32" => WeightFormat::F32,
            other => panic!("unknown weight format {other}"),
        };
    }
    if let Some(d) = args.get(2) {
        options.dense_min_rows = d.parse().ok();
    }
    let path = ensure_default_model(&home_dir()).expect("default model");
    let t = Instant::now();
    let model = Model::load_with(&path, &options).unwrap();
    let load_s = t.elapsed().as_secs_f64();
    let prompt = long_prompt(&model);
    let (prefill, decode, long_decode) = bench_ours(&model, &prompt, threads);
    let ours_rss = peak_rss_mib();
    drop(model);
    let candle = (!ours_only).then(|| bench_candle(&path, &prompt, threads));
    let total_rss = peak_rss_mib();

    println!(
        "model: {} ({threads} threads), ours loaded in {load_s:.1}s with {options:?}",
        path.display()
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "tokens/s by wall clock, and in parentheses by CPU time / threads (an estimate for an \
         idle machine; spin-waiting code is penalised); load average at the end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!();
    println!("| engine | prefill tok/s ({PROMPT_TOKENS}-tok prompt) | decode b=1 | b=4 | b=8 | b=16 | b=1 after the prompt | peak RSS |");
    println!("|---|---|---|---|---|---|---|---|");
    let d = |b: usize| {
        decode
            .iter()
            .find(|(x, _)| *x == b)
            .map(|(_, v)| *v)
            .unwrap()
    };
    println!(
        "| pdserve-model ({:?} weights, {}, f16 KV) | {prefill} | {} | {} | {} | {} | {long_decode} | {ours_rss:.0} MiB |",
        options.weights,
        options
            .dense_min_rows
            .map_or("no f32 GEMM".to_string(), |r| format!("f32 GEMM for steps of {r}+ rows")),
        d(1),
        d(4),
        d(8),
        d(16)
    );
    if let Some((candle_prefill, candle_decode)) = candle {
        println!(
            "| candle-transformers quantized_llama (Q4_1 as shipped) | {candle_prefill} | {candle_decode} | – | – | – | – | {total_rss:.0} MiB (process peak) |"
        );
    }
}
