//! `pdserve bench trace-gen`: synthetic traces in Mooncake's format (see [`crate::trace`])
//! for `serve --dataset mooncake`, with the features that make serving hard:
//!
//! - Arrivals: a Poisson process at `--request-rate`, optionally bursty: for
//!   `--burst-fraction` of every `--burst-period-s` the rate is `--burst-factor` times the
//!   rest's, scaled so that the mean stays `--request-rate`.
//! - Shared prefixes: `--prefix-groups` prefixes of `--prefix-blocks` 512-token blocks
//!   (system prompts, tools, documents); each request or session starts with one, group
//!   k (from 1) drawn with weight `1 / k^s` (Zipf, `--prefix-zipf s`; 0 is uniform).
//! - Sessions: `--session-share` of the requests belong to sessions of
//!   `--session-turns` turns. Each turn's prompt is the previous turn's prompt, its
//!   answer and a new message, so its `hash_ids` extend the previous turn's; turns are
//!   `--think-time-s` apart on average (exponential).
//! - Lengths: uniform in `[len (1 - r), len (1 + r)]` for `--input-len` (a request's own
//!   tokens after its shared prefix), `--turn-input-len` (a later turn's new message) and
//!   `--output-len`, with `r` = `--range-ratio`.
//!
//! Hash ids are numbered from 0 in the order blocks are made, as in Mooncake's traces.
//! One seeded generator draws everything, so the same flags and `--seed` write the same
//! file.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Zipf};
use serde::Serialize;

use crate::arg_values::{parse_f64, positive_finite, positive_rate, range_ratio};
use crate::trace::{reusable_token_share, TraceEntry, BLOCK_TOKENS};
use crate::BenchError;

/// `pdserve bench trace-gen`.
#[derive(Debug, Clone, Args)]
pub struct TraceGenArgs {
    /// Write the trace to this file (one JSON request per line; session turns also carry
    /// `session_id` and `turn`, which readers ignore).
    #[arg(long, env = "PDSERVE_BENCH_OUTPUT", value_name = "FILE")]
    pub output: PathBuf,
    /// Seconds of arrivals: the last request is sent before this time.
    #[arg(long, env = "PDSERVE_BENCH_DURATION_S", default_value_t = 60.0, value_parser = positive_seconds)]
    pub duration_s: f64,
    /// Mean rate of requests (session turns included), per second, as a Poisson process.
    #[arg(long, env = "PDSERVE_BENCH_REQUEST_RATE", default_value_t = 1.0, value_parser = positive_rate)]
    pub request_rate: f64,
    /// Mean tokens of a request's own prompt, after its shared prefix (a session's
    /// first turn too).
    #[arg(long, env = "PDSERVE_BENCH_INPUT_LEN", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub input_len: u64,
    /// Mean output tokens of a request.
    #[arg(long, env = "PDSERVE_BENCH_OUTPUT_LEN", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub output_len: u64,
    /// Spread of lengths: each is drawn uniformly from [len * (1 - r), len * (1 + r)].
    #[arg(long, env = "PDSERVE_BENCH_RANGE_RATIO", default_value_t = 0.0, value_parser = range_ratio)]
    pub range_ratio: f64,
    /// Shared prefixes (0: none). Every request, or session, starts with one.
    #[arg(long, env = "PDSERVE_BENCH_PREFIX_GROUPS", default_value_t = 0)]
    pub prefix_groups: u64,
    /// Length of each shared prefix, in 512-token blocks.
    #[arg(long, env = "PDSERVE_BENCH_PREFIX_BLOCKS", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub prefix_blocks: u64,
    /// Zipf exponent s of prefix popularity: group k (from 1) is drawn with weight
    /// 1 / k^s (0: all groups alike; 1: the first twice as popular as the second).
    #[arg(long, env = "PDSERVE_BENCH_PREFIX_ZIPF", default_value_t = 1.0, value_parser = non_negative)]
    pub prefix_zipf: f64,
    /// Share of the requests that are turns of multi-turn sessions, in [0, 1].
    #[arg(long, env = "PDSERVE_BENCH_SESSION_SHARE", default_value_t = 0.0, value_parser = share)]
    pub session_share: f64,
    /// Turns per session (turns that would fall after `--duration-s` are dropped).
    #[arg(long, env = "PDSERVE_BENCH_SESSION_TURNS", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub session_turns: u64,
    /// Mean tokens of each later turn's new message.
    #[arg(long, env = "PDSERVE_BENCH_TURN_INPUT_LEN", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub turn_input_len: u64,
    /// Mean seconds from one turn's send to the next's (exponential). A trace's times are
    /// fixed, so this covers the answer's generation as well as the user's thinking.
    #[arg(long, env = "PDSERVE_BENCH_THINK_TIME_S", default_value_t = 10.0, value_parser = non_negative)]
    pub think_time_s: f64,
    /// Bursts: the arrival rate during a burst over the rate outside one (1: no bursts).
    #[arg(long, env = "PDSERVE_BENCH_BURST_FACTOR", default_value_t = 1.0, value_parser = at_least_one)]
    pub burst_factor: f64,
    /// Bursts: seconds from one burst's start to the next's.
    #[arg(long, env = "PDSERVE_BENCH_BURST_PERIOD_S", default_value_t = 60.0, value_parser = positive_seconds)]
    pub burst_period_s: f64,
    /// Bursts: the fraction of each period that bursts (its start), in (0, 1).
    #[arg(long, env = "PDSERVE_BENCH_BURST_FRACTION", default_value_t = 0.1, value_parser = open_fraction)]
    pub burst_fraction: f64,
    /// Seed of everything drawn (same flags and seed, same file).
    #[arg(long, env = "PDSERVE_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    positive_finite(s, "a duration in seconds")
}

fn non_negative(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number >= 0, got `{s}`"))
    }
}

fn share(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("a share must be in [0, 1], got `{s}`"))
    }
}

fn open_fraction(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v > 0.0 && v < 1.0 {
        Ok(v)
    } else {
        Err(format!("a fraction must be in (0, 1), got `{s}`"))
    }
}

fn at_least_one(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v.is_finite() && v >= 1.0 {
        Ok(v)
    } else {
        Err(format!(
            "a burst factor must be a finite number >= 1, got `{s}`"
        ))
    }
}

/// One generated request: the trace line and, for a session turn, where it belongs.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedRequest {
    /// The request as the trace has it.
    pub entry: TraceEntry,
    /// Session turns: the session (from 0) and the turn in it (from 0).
    pub session: Option<(u64, u64)>,
}

/// A trace line as written: the Mooncake fields, and a session turn's place.
#[derive(Serialize)]
struct Line<'a> {
    #[serde(flatten)]
    entry: &'a TraceEntry,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    turn: Option<u64>,
}

/// Draws everything from one seeded stream and numbers hash blocks.
struct Generator<'a> {
    args: &'a TraceGenArgs,
    rng: StdRng,
    next_id: u64,
}

impl Generator<'_> {
    /// `n` new hash ids.
    fn new_ids(&mut self, n: u64) -> impl Iterator<Item = u64> {
        let first = self.next_id;
        self.next_id += n;
        first..first + n
    }

    /// A length uniform in `[mean (1 - r), mean (1 + r)]`, at least 1.
    fn length(&mut self, mean: u64) -> u64 {
        let r = self.args.range_ratio;
        let low = ((mean as f64) * (1.0 - r)).floor().max(1.0) as u64;
        let high = ((mean as f64) * (1.0 + r)).ceil().max(1.0) as u64;
        self.rng.random_range(low..=high.max(low))
    }

    /// Ids for a prompt of `input_length` tokens starting with `ids`: new ids for the
    /// blocks past them, so that every block of the prompt has one.
    fn extend(&mut self, mut ids: Vec<u64>, input_length: u64) -> Vec<u64> {
        let more = TraceEntry::max_blocks(input_length).saturating_sub(ids.len() as u64);
        ids.extend(self.new_ids(more));
        ids
    }

    fn request(
        &mut self,
        at_s: f64,
        prefix: &[u64],
        session: Option<(u64, u64)>,
    ) -> GeneratedRequest {
        let input_length = prefix.len() as u64 * BLOCK_TOKENS + self.length(self.args.input_len);
        GeneratedRequest {
            entry: TraceEntry {
                timestamp: (at_s * 1e3).round(),
                input_length,
                output_length: self.length(self.args.output_len),
                hash_ids: self.extend(prefix.to_vec(), input_length),
            },
            session,
        }
    }
}

/// The requests `args` describe, sorted by timestamp (whole ms).
pub fn generate(args: &TraceGenArgs) -> Vec<GeneratedRequest> {
    let mut g = Generator {
        args,
        rng: StdRng::seed_from_u64(args.seed),
        next_id: 0,
    };
    let prefixes: Vec<Vec<u64>> = (0..args.prefix_groups)
        .map(|_| g.new_ids(args.prefix_blocks).collect())
        .collect();
    // Zipf over 1..=groups; `prefix_zipf` is checked finite and >= 0, which it accepts.
    let popularity = Zipf::new(args.prefix_groups.max(1) as f64, args.prefix_zipf).ok();
    // An arrival starts a session with probability p, so that sessions' turns are
    // `session_share` of all requests: p N / (p N + 1 - p) = share.
    let turns = args.session_turns as f64;
    let share = args.session_share;
    let p_session = share / (turns * (1.0 - share) + share);
    let arrival_rate = args.request_rate / (p_session * turns + 1.0 - p_session);
    // Bursts: arrivals come at the peak rate and are thinned outside bursts, with the
    // base rate set so that the mean over a period is `arrival_rate`.
    let f = args.burst_factor;
    let base = arrival_rate / (1.0 + (f - 1.0) * args.burst_fraction);
    let gaps = Exp::new(base * f).unwrap_or_else(|_| Exp::new(1.0).expect("1 is a valid rate"));
    let think = (args.think_time_s > 0.0)
        .then(|| Exp::new(1.0 / args.think_time_s).ok())
        .flatten();

    let mut out = Vec::new();
    let mut sessions = 0u64;
    let mut t = 0.0f64;
    loop {
        t += gaps.sample(&mut g.rng);
        if t >= args.duration_s {
            break;
        }
        let in_burst = (t % args.burst_period_s) < args.burst_fraction * args.burst_period_s;
        if !in_burst && g.rng.random::<f64>() >= 1.0 / f {
            continue;
        }
        let prefix = match &popularity {
            Some(zipf) if !prefixes.is_empty() => {
                // Zipf samples are whole numbers in [1, groups] as floats.
                let k = (zipf.sample(&mut g.rng) as usize).clamp(1, prefixes.len());
                prefixes[k - 1].clone()
            }
            _ => Vec::new(),
        };
        if g.rng.random::<f64>() >= p_session {
            out.push(g.request(t, &prefix, None));
            continue;
        }
        let session = sessions;
        sessions += 1;
        let mut turn = g.request(t, &prefix, Some((session, 0)));
        let mut at = t;
        for k in 1..args.session_turns {
            at += think.map_or(0.0, |d| d.sample(&mut g.rng));
            if at >= args.duration_s {
                break;
            }
            // The next prompt: this prompt, its answer and a new message.
            let input_length =
                turn.entry.input_length + turn.entry.output_length + g.length(args.turn_input_len);
            let next = GeneratedRequest {
                entry: TraceEntry {
                    timestamp: (at * 1e3).round(),
                    input_length,
                    output_length: g.length(args.output_len),
                    hash_ids: g.extend(turn.entry.hash_ids.clone(), input_length),
                },
                session: Some((session, k)),
            };
            out.push(std::mem::replace(&mut turn, next));
        }
        out.push(turn);
    }
    // Stable: requests at the same millisecond keep the order they were made in.
    out.sort_by(|a, b| a.entry.timestamp.total_cmp(&b.entry.timestamp));
    out
}

/// Writes `requests` in Mooncake's format: one JSON object per line.
pub fn write_trace(
    path: &std::path::Path,
    requests: &[GeneratedRequest],
) -> Result<(), BenchError> {
    let io = |e: std::io::Error| BenchError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for r in requests {
        let line = Line {
            entry: &r.entry,
            session_id: r.session.map(|(s, _)| s),
            turn: r.session.map(|(_, t)| t),
        };
        serde_json::to_writer(&mut file, &line).map_err(|e| BenchError::Json(e.to_string()))?;
        file.write_all(b"\n").map_err(io)?;
    }
    file.flush().map_err(io)
}

/// Generates the trace `args` describe, writes it and prints what it holds.
pub fn run_trace_gen(args: &TraceGenArgs) -> Result<(), BenchError> {
    let requests = generate(args);
    write_trace(&args.output, &requests)?;
    let n = requests.len().max(1) as f64;
    let mean =
        |f: fn(&TraceEntry) -> u64| requests.iter().map(|r| f(&r.entry)).sum::<u64>() as f64 / n;
    let in_sessions = requests.iter().filter(|r| r.session.is_some()).count();
    let entries: Vec<TraceEntry> = requests.iter().map(|r| r.entry.clone()).collect();
    println!(
        "wrote {} requests over {:.0} s ({:.2} req/s; {in_sessions} in sessions) to {}",
        requests.len(),
        args.duration_s,
        requests.len() as f64 / args.duration_s,
        args.output.display()
    );
    println!(
        "mean input {:.0} tokens, mean output {:.0} tokens, reusable prompt-token share {:.1}%",
        mean(|e| e.input_length),
        mean(|e| e.output_length),
        reusable_token_share(&entries).unwrap_or(0.0) * 100.0
    );
    Ok(())
}
