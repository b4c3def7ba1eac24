//! `pdserve bench kv-index`: what routing on KV events costs the gateway as the fleet
//! grows, measured in process on synthetic events, with no workers and no network.
//!
//! - Ingestion: vLLM-shaped `BlockStored` batches (msgpack, chained parents) decoded and
//!   applied to one worker index at a time on one thread, as a subscriber task does.
//! - Memory: the process's resident set before and after the indexes fill.
//! - Routing: `precise_prefix` choosing among every worker for prompts that one worker
//!   holds or none does, timed per decision, at three fill levels (1%, 10% and all of
//!   `--blocks`), so lookup time can be read against blocks indexed.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_protocol::kv_events::{decode, encode, EngineBlockHash, KvCacheEvent, KvEventBatch};
use pdserve_protocol::WorkerRole;
use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;

use super::sent_blocks::{remembered_of, PENDING_BLOCKS};
use super::{CacheAware, Policy, PolicyConfig, PrecisePrefix, RouteRequest};
use crate::endpoint::Endpoint;
use crate::fleet::kv_events::{KvEventMetrics, KvEventsConfig, KvEventsHub, WorkerEvents};
use crate::fleet::registry::{Worker, WorkerSpec};

/// Flags of `pdserve bench kv-index`.
#[derive(Debug, Clone, clap::Args)]
pub struct KvIndexBenchArgs {
    /// Workers whose indexes are filled and routed across.
    #[arg(long, env = "PDSERVE_BENCH_WORKERS", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub workers: u32,
    /// Blocks indexed in all, spread evenly over the workers (lookups are also timed at
    /// 1% and 10% of it).
    #[arg(long, env = "PDSERVE_BENCH_BLOCKS", default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub blocks: u64,
    /// Tokens per block (vLLM's and pdserve's default).
    #[arg(long, env = "PDSERVE_BENCH_BLOCK_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub block_size: u32,
    /// Tokens of each routed prompt; the indexed prefixes are prompts of this length.
    #[arg(long, env = "PDSERVE_BENCH_PROMPT_TOKENS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub prompt_tokens: u32,
    /// Blocks per `BlockStored` event (a scheduler step's new full blocks for one
    /// request: a 256-token prefill chunk is 16).
    #[arg(long, env = "PDSERVE_BENCH_BLOCKS_PER_EVENT", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub blocks_per_event: u32,
    /// Events per published batch (vLLM publishes one batch per scheduler step).
    #[arg(long, env = "PDSERVE_BENCH_EVENTS_PER_BATCH", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub events_per_batch: u32,
    /// Block hashes as 32-byte digests (vLLM's sha256 hashing) instead of integers.
    #[arg(long, env = "PDSERVE_BENCH_DIGEST_HASHES")]
    pub digest_hashes: bool,
    /// Routing decisions timed at each fill level: half for prompts one worker holds,
    /// half for new ones.
    #[arg(long, env = "PDSERVE_BENCH_DECISIONS", default_value_t = 4000, value_parser = clap::value_parser!(u32).range(2..=10_000_000))]
    pub decisions: u32,
    /// Write 64 MiB between timed decisions, so each finds the CPU caches as a live
    /// gateway does after handling a request (parsing, HTTP, other tasks): the workers'
    /// state is no longer cached, and each candidate read costs its memory misses.
    #[arg(long, env = "PDSERVE_BENCH_COLD_CACHE")]
    pub cold_cache: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, env = "PDSERVE_BENCH_RESULT_JSON")]
    pub result_json: Option<PathBuf>,
}

/// Decode and apply rates of one run of events.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct IngestionReport {
    /// Events applied.
    pub events: u64,
    /// Blocks they stored.
    pub blocks: u64,
    /// Seconds spent decoding msgpack.
    pub decode_seconds: f64,
    /// Seconds spent applying to the indexes (lock included).
    pub apply_seconds: f64,
    /// Events per second of decode plus apply, on one thread.
    pub events_per_second: f64,
    /// Blocks per second of decode plus apply, on one thread.
    pub blocks_per_second: f64,
}

/// Routing decisions at one fill level.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LookupReport {
    /// Blocks indexed over all workers when timed.
    pub blocks_indexed: u64,
    /// Decisions for prompts one worker holds: p50, p99 and max in microseconds.
    pub hit_us: Percentiles,
    /// Decisions for prompts no worker holds.
    pub miss_us: Percentiles,
    /// Share of held prompts routed to the worker that holds them.
    pub hits_routed_home: f64,
}

/// Percentiles of a timing, in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Slowest.
    pub max: f64,
}

/// What `pdserve bench kv-index` measured.
#[derive(Debug, Clone, Serialize)]
pub struct KvIndexReport {
    /// Workers.
    pub workers: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Tokens per prompt.
    pub prompt_tokens: u32,
    /// Whether block hashes were digests.
    pub digest_hashes: bool,
    /// Whether the CPU caches were emptied before each timed decision (`--cold-cache`).
    pub cold_cache: bool,
    /// New prompts routed untimed before the first timed decision (see `warm_up`).
    pub warm_up_decisions: u64,
    /// Ingestion while the indexes filled.
    pub ingestion: IngestionReport,
    /// Resident bytes the indexes added, per block indexed.
    pub bytes_per_block: f64,
    /// Resident MiB the indexes added per million blocks.
    pub mib_per_million_blocks: f64,
    /// Routing decisions at each fill level.
    pub lookups: Vec<LookupReport>,
}

/// splitmix64: the synthetic tokens and hashes, reproducible run to run.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The tokens of prompt `n` (prompts are distinct from their first block on).
fn prompt(n: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| (mix(n.wrapping_mul(1_000_003).wrapping_add(i)) % 49_152) as u32)
        .collect()
}

fn engine_hash(seq: u64, digest: bool) -> EngineBlockHash {
    if digest {
        let bytes = (0..4u64)
            .flat_map(|i| mix(seq * 4 + i).to_le_bytes())
            .collect();
        EngineBlockHash::Bytes(bytes)
    } else {
        EngineBlockHash::Int(mix(seq))
    }
}

/// The payloads a worker publishes for prompt `tokens` computed from scratch: events of
/// `blocks_per_event` chained blocks, `events_per_batch` to a batch. `next_hash` numbers
/// the engine's hashes.
fn publish(tokens: &[u32], args: &KvIndexBenchArgs, next_hash: &mut u64) -> Vec<Vec<u8>> {
    let size = args.block_size as usize;
    let per_event = args.blocks_per_event as usize * size;
    let mut parent: Option<EngineBlockHash> = None;
    let events: Vec<KvCacheEvent> = tokens
        .chunks(per_event)
        .map(|chunk| {
            let full = chunk.len() / size * size;
            let block_hashes: Vec<_> = (0..full / size)
                .map(|_| {
                    *next_hash += 1;
                    engine_hash(*next_hash, args.digest_hashes)
                })
                .collect();
            let event = KvCacheEvent::BlockStored {
                parent_block_hash: parent.clone(),
                block_hashes: block_hashes.clone(),
                token_ids: chunk[..full].to_vec(),
                block_size: args.block_size,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
            };
            parent = block_hashes.last().cloned();
            event
        })
        .filter(|e| matches!(e, KvCacheEvent::BlockStored { block_hashes, .. } if !block_hashes.is_empty()))
        .collect();
    events
        .chunks(args.events_per_batch as usize)
        .map(|events| {
            encode(&KvEventBatch {
                ts: 0.0,
                events: events.to_vec(),
                data_parallel_rank: None,
            })
        })
        .collect()
}

/// Decodes and applies `payloads` to `index`, adding the time each took to `report`.
fn ingest(index: &WorkerEvents, payloads: &[Vec<u8>], report: &mut IngestionReport) {
    for payload in payloads {
        let began = Instant::now();
        let decoded = decode(payload).expect("the bench's own payloads decode");
        let decoded_at = Instant::now();
        let mut blocks = 0;
        {
            let mut index = index.lock();
            for event in &decoded.batch.events {
                blocks += index.apply(event).map_or(0, |a| a.stored) as u64;
            }
        }
        report.apply_seconds += decoded_at.elapsed().as_secs_f64();
        report.decode_seconds += (decoded_at - began).as_secs_f64();
        report.events += decoded.batch.events.len() as u64;
        report.blocks += blocks;
    }
}

/// This process's resident bytes (Linux; 0 elsewhere).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn percentiles(mut times: Vec<Duration>) -> Percentiles {
    times.sort_unstable();
    let at = |q: f64| {
        let i = ((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1;
        times[i].as_secs_f64() * 1e6
    };
    Percentiles {
        p50: at(0.5),
        p99: at(0.99),
        max: at(1.0),
    }
}

/// A completion request for the token-id prompt `tokens`, as the gateway routes it.
fn token_prompt<'a>(headers: &'a http::HeaderMap, tokens: &'a [u32]) -> RouteRequest<'a> {
    RouteRequest {
        endpoint: Endpoint::Completions,
        request: None,
        headers,
        conversation_id: None,
        tokens: Some(tokens),
        notes: None,
        prefer: None,
        trace: None,
        seen: None,
        slo: Default::default(),
        local_prefill: false,
    }
}

/// New prompts routed untimed until the record of the prompts just sent is full
/// (`PENDING_BLOCKS`), as in a gateway that has served a while: its map has grown to its
/// size and no longer reallocates in the middle of a decision.
fn warm_up(policy: &PrecisePrefix, fleet: &[Arc<Worker>], args: &KvIndexBenchArgs) -> u64 {
    let headers = http::HeaderMap::new();
    let blocks_per_prompt = (args.prompt_tokens / args.block_size).max(1) as usize;
    // A margin for rendezvous hashing, which spreads new prompts only about evenly.
    let prompts = PENDING_BLOCKS.div_ceil(remembered_of(blocks_per_prompt)) * 5 / 4;
    for n in 0..prompts as u64 {
        let tokens = prompt(u64::MAX / 4 + n, args.prompt_tokens as usize);
        let route = token_prompt(&headers, &tokens);
        policy.select(WorkerRole::Prefill, fleet, &route);
    }
    prompts as u64
}

/// What `--cold-cache` reads between decisions: twice a large server's last-level cache.
const COLD_CACHE_BYTES: usize = 64 << 20;

/// Writes a byte of every cache line of `buffer`, pushing everything else out of the
/// CPU caches.
fn evict_caches(buffer: &mut [u8]) {
    for line in buffer.chunks_mut(64) {
        line[0] = line[0].wrapping_add(1);
    }
    std::hint::black_box(buffer);
}

/// Times `decisions` choices among `fleet`: even ones for a prompt of `held` (each held
/// by the worker at its index modulo the fleet), odd ones for a new prompt.
fn time_decisions(
    policy: &PrecisePrefix,
    fleet: &[Arc<Worker>],
    held: u64,
    args: &KvIndexBenchArgs,
    round: u64,
) -> LookupReport {
    let headers = http::HeaderMap::new();
    let len = args.prompt_tokens as usize;
    let (mut hits, mut misses, mut home) = (Vec::new(), Vec::new(), 0usize);
    let mut evictor = args.cold_cache.then(|| vec![1u8; COLD_CACHE_BYTES]);
    for d in 0..u64::from(args.decisions) {
        if let Some(evictor) = evictor.as_mut() {
            evict_caches(evictor);
        }
        let is_hit = d % 2 == 0 && held > 0;
        let n = if is_hit {
            mix(round * 7 + d) % held
        } else {
            // New prompts: numbered past every held one, never repeated.
            u64::MAX / 2 + round * 100_000_000 + d
        };
        let tokens = prompt(n, len);
        let route = token_prompt(&headers, &tokens);
        let began = Instant::now();
        let chosen = policy.select(WorkerRole::Prefill, fleet, &route);
        let took = began.elapsed();
        let chosen = chosen.expect("a non-empty fleet always yields a worker");
        if is_hit {
            home += usize::from(chosen.base == fleet[(n % fleet.len() as u64) as usize].base);
            hits.push(took);
        } else {
            misses.push(took);
        }
    }
    let empty = Percentiles {
        p50: 0.0,
        p99: 0.0,
        max: 0.0,
    };
    LookupReport {
        blocks_indexed: 0,
        hits_routed_home: home as f64 / hits.len().max(1) as f64,
        hit_us: if hits.is_empty() {
            empty
        } else {
            percentiles(hits)
        },
        miss_us: percentiles(misses),
    }
}

/// Flags that leave the benchmark nothing to measure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvIndexBenchError {
    /// A prompt shorter than a block has no full block to index or match.
    #[error("--prompt-tokens ({prompt_tokens}) must be at least --block-size ({block_size}): a prompt shorter than a block has no block to index")]
    PromptShorterThanBlock {
        /// `--prompt-tokens`.
        prompt_tokens: u32,
        /// `--block-size`.
        block_size: u32,
    },
}

/// Runs the benchmark.
pub fn run(args: &KvIndexBenchArgs) -> Result<KvIndexReport, KvIndexBenchError> {
    if args.prompt_tokens < args.block_size {
        return Err(KvIndexBenchError::PromptShorterThanBlock {
            prompt_tokens: args.prompt_tokens,
            block_size: args.block_size,
        });
    }
    let workers = args.workers as usize;
    let size = args.block_size as usize;
    let blocks_per_prompt = (args.prompt_tokens as usize / size).max(1) as u64;
    let prompts = args.blocks.div_ceil(blocks_per_prompt);
    let per_worker = args.blocks.div_ceil(workers as u64) as usize;
    let config = KvEventsConfig {
        // Room for every block sent, so nothing is evicted while filling.
        max_indexed_blocks: NonZeroUsize::new(per_worker + blocks_per_prompt as usize)
            .expect("at least one block"),
        ..KvEventsConfig::default()
    };
    let metrics = Arc::new(KvEventMetrics::register(&mut Default::default()));
    let hub = Arc::new(KvEventsHub::new(config, metrics));
    let fleet: Vec<Arc<Worker>> = (0..workers)
        .map(|i| {
            // Names only: the bench sends nothing.
            let url = format!("http://127.0.0.1:{}", 20_000 + i % 40_000);
            let spec = WorkerSpec::new(WorkerRole::Prefill, url.parse().expect("a valid URL"));
            Arc::new(Worker::new(spec, Gauge::default()))
        })
        .collect();
    let indexes: Vec<Arc<WorkerEvents>> = fleet
        .iter()
        .map(|w| {
            hub.collected(&w.base)
                .expect("no subscriptions in the bench")
        })
        .collect();
    let policy = PrecisePrefix::new(
        hub.clone(),
        CacheAware::new(&PolicyConfig::default()),
        PolicyConfig::default().precise_load_cost,
    );
    let levels: Vec<u64> = [prompts / 100, prompts / 10, prompts]
        .into_iter()
        .filter(|p| *p > 0)
        .collect();
    // Only the fills count: the decisions between them add the gateway's record of
    // prompts just sent, which is not the index.
    let mut added = 0u64;
    let (mut ingestion, mut lookups) = (IngestionReport::default(), Vec::new());
    let (mut filled, mut next_hash) = (0u64, 0u64);
    let warm_up_decisions = warm_up(&policy, &fleet, args);
    for (round, level) in levels.iter().enumerate() {
        let rss_before = resident_bytes();
        while filled < *level {
            let payloads = publish(
                &prompt(filled, args.prompt_tokens as usize),
                args,
                &mut next_hash,
            );
            ingest(
                &indexes[(filled % workers as u64) as usize],
                &payloads,
                &mut ingestion,
            );
            filled += 1;
        }
        added += resident_bytes().saturating_sub(rss_before);
        let indexed: u64 = indexes.iter().map(|i| i.lock().len() as u64).sum();
        let mut lookup = time_decisions(&policy, &fleet, filled, args, round as u64);
        lookup.blocks_indexed = indexed;
        lookups.push(lookup);
    }
    let indexed: u64 = indexes.iter().map(|i| i.lock().len() as u64).sum();
    let added = added as f64;
    let busy = ingestion.decode_seconds + ingestion.apply_seconds;
    ingestion.events_per_second = ingestion.events as f64 / busy.max(f64::MIN_POSITIVE);
    ingestion.blocks_per_second = ingestion.blocks as f64 / busy.max(f64::MIN_POSITIVE);
    let bytes_per_block = added / indexed.max(1) as f64;
    Ok(KvIndexReport {
        workers: args.workers,
        block_size: args.block_size,
        prompt_tokens: args.prompt_tokens,
        digest_hashes: args.digest_hashes,
        cold_cache: args.cold_cache,
        warm_up_decisions,
        ingestion,
        bytes_per_block,
        mib_per_million_blocks: bytes_per_block * 1e6 / (1024.0 * 1024.0),
        lookups,
    })
}

impl std::fmt::Display for KvIndexReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hashes = if self.digest_hashes {
            "32-byte digest"
        } else {
            "integer"
        };
        writeln!(
            f,
            "KV-event index: {} workers, {}-token blocks, {}-token prompts, {hashes} block hashes",
            self.workers, self.block_size, self.prompt_tokens
        )?;
        let i = &self.ingestion;
        writeln!(
            f,
            "ingestion (one thread): {:.0} events/s, {:.0} blocks/s ({} events; decode {:.2} s, apply {:.2} s)",
            i.events_per_second, i.blocks_per_second, i.events, i.decode_seconds, i.apply_seconds
        )?;
        writeln!(
            f,
            "memory: {:.0} bytes per block indexed, {:.0} MiB per million blocks",
            self.bytes_per_block, self.mib_per_million_blocks
        )?;
        writeln!(
            f,
            "precise_prefix decision over all {} workers, µs (after {} new prompts routed untimed{}):",
            self.workers,
            self.warm_up_decisions,
            if self.cold_cache { "; caches emptied before each" } else { "" }
        )?;
        writeln!(
            f,
            "{:>14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "blocks", "hit p50", "hit p99", "hit max", "new p50", "new p99", "new max", "home"
        )?;
        for l in &self.lookups {
            writeln!(
                f,
                "{:>14} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.0}%",
                l.blocks_indexed,
                l.hit_us.p50,
                l.hit_us.p99,
                l.hit_us.max,
                l.miss_us.p50,
                l.miss_us.p99,
                l.miss_us.max,
                l.hits_routed_home * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_fleet_indexes_every_block_and_routes_held_prompts_home() {
        let args = KvIndexBenchArgs {
            workers: 4,
            blocks: 800,
            block_size: 16,
            prompt_tokens: 160,
            blocks_per_event: 3,
            events_per_batch: 2,
            digest_hashes: true,
            decisions: 40,
            cold_cache: true,
            result_json: None,
        };
        let report = run(&args).unwrap();
        // 80 prompts of 10 blocks: events of 3, 3, 3 and 1 block.
        assert_eq!(report.ingestion.blocks, 800);
        assert_eq!(report.ingestion.events, 320);
        let full = report.lookups.last().unwrap();
        assert_eq!(full.blocks_indexed, 800);
        assert_eq!(report.lookups.len(), 2, "1% of 80 prompts is none");
        assert_eq!(full.hits_routed_home, 1.0);
        assert!(full.hit_us.p50 <= full.hit_us.p99 && full.hit_us.p99 <= full.hit_us.max);
        let short = KvIndexBenchArgs {
            prompt_tokens: 15,
            ..args
        };
        assert_eq!(
            run(&short).unwrap_err(),
            KvIndexBenchError::PromptShorterThanBlock {
                prompt_tokens: 15,
                block_size: 16
            }
        );
    }
}
