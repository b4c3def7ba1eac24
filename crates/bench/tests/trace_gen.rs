//! `trace-gen`: the same seed writes the same file, which the trace reader reads back;
//! prefix popularity is Zipf-skewed, session turns extend the previous turn's blocks,
//! and arrivals keep the asked rate, bursts included.

mod support;

use std::collections::BTreeMap;

use pdserve_bench::trace::{read_trace, TraceEntry, BLOCK_TOKENS};
use pdserve_bench::trace_gen::{generate, run_trace_gen, GeneratedRequest};
use pdserve_bench::{BenchCommand, TraceGenArgs};
use support::{parse, scratch};

fn args(flags: &[&str]) -> TraceGenArgs {
    let mut all = vec!["trace-gen", "--output", "unused.jsonl"];
    all.extend_from_slice(flags);
    match parse(&all).expect("valid trace-gen flags") {
        BenchCommand::TraceGen(a) => a,
        other => panic!("not trace-gen: {other:?}"),
    }
}

fn entries(requests: &[GeneratedRequest]) -> Vec<TraceEntry> {
    requests.iter().map(|r| r.entry.clone()).collect()
}

#[test]
fn same_seed_same_file_and_the_reader_reads_it_back() {
    let flags = [
        "--duration-s",
        "120",
        "--request-rate",
        "3",
        "--prefix-groups",
        "4",
        "--session-share",
        "0.5",
        "--think-time-s",
        "5",
        "--range-ratio",
        "0.5",
        "--burst-factor",
        "3",
        "--burst-period-s",
        "30",
    ];
    let mut a = args(&flags);
    let (path_a, path_b) = (scratch("gen-a.jsonl"), scratch("gen-b.jsonl"));
    a.output = path_a.clone();
    run_trace_gen(&a).expect("write");
    a.output = path_b.clone();
    run_trace_gen(&a).expect("write again");
    let text = std::fs::read_to_string(&path_a).unwrap();
    assert_eq!(
        text,
        std::fs::read_to_string(&path_b).unwrap(),
        "same seed, same file"
    );
    let mut seeded = flags.to_vec();
    seeded.extend(["--seed", "1"]);
    assert_ne!(
        entries(&generate(&args(&seeded))),
        entries(&generate(&a)),
        "another seed"
    );

    let generated = generate(&a);
    let trace = read_trace(&path_a, None).expect("the reader takes the generator's file");
    assert_eq!(trace.entries, entries(&generated));
    assert_eq!(trace.out_of_order, 0, "written in timestamp order");
    // Mooncake's layout: whole-ms integer timestamps, one id per block, session fields.
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(first["timestamp"].is_u64(), "{first}");
    assert!(text.contains("\"session_id\":") && text.contains("\"turn\":"));
    for e in &trace.entries {
        assert_eq!(
            e.hash_ids.len() as u64,
            TraceEntry::max_blocks(e.input_length),
            "{e:?}"
        );
        assert!(e.output_length >= 1);
    }
}

#[test]
fn prefix_popularity_follows_zipf() {
    let generated = generate(&args(&[
        "--duration-s",
        "1000",
        "--request-rate",
        "4",
        "--prefix-groups",
        "8",
        "--prefix-blocks",
        "2",
        "--prefix-zipf",
        "1",
        "--input-len",
        "100",
    ]));
    // Group g's prefix is ids 2g, 2g + 1 (prefixes are numbered first).
    let mut counts = [0u64; 8];
    for r in &generated {
        let ids = &r.entry.hash_ids;
        let group = (ids[0] / 2) as usize;
        assert_eq!(ids[..2], [2 * group as u64, 2 * group as u64 + 1]);
        assert!(
            ids[2..].iter().all(|&id| id >= 16),
            "own blocks after the prefix"
        );
        assert_eq!(r.entry.input_length, 2 * BLOCK_TOKENS + 100);
        counts[group] += 1;
    }
    let n = generated.len() as f64;
    // Weight 1/k over H(8) = 2.718: group 1 ≈ 36.8%, group 8 ≈ 4.6%.
    let harmonic: f64 = (1..=8).map(|k| 1.0 / k as f64).sum();
    for (k, &c) in counts.iter().enumerate() {
        let expected = 1.0 / ((k + 1) as f64 * harmonic);
        assert!(
            (c as f64 / n - expected).abs() < 0.03,
            "group {}: {counts:?}",
            k + 1
        );
    }
    assert!(counts.windows(2).take(3).all(|w| w[0] > w[1]), "{counts:?}");

    let uniform = generate(&args(&[
        "--duration-s",
        "1000",
        "--request-rate",
        "4",
        "--prefix-groups",
        "8",
        "--prefix-zipf",
        "0",
    ]));
    let mut counts = [0u64; 8];
    for r in &uniform {
        counts[(r.entry.hash_ids[0] / 4) as usize] += 1;
    }
    let n = uniform.len() as f64;
    assert!(
        counts.iter().all(|&c| (c as f64 / n - 0.125).abs() < 0.03),
        "{counts:?}"
    );
}

#[test]
fn session_turns_extend_the_previous_turns_blocks() {
    let generated = generate(&args(&[
        "--duration-s",
        "600",
        "--request-rate",
        "2",
        "--session-share",
        "0.6",
        "--session-turns",
        "3",
        "--think-time-s",
        "4",
        "--input-len",
        "700",
        "--turn-input-len",
        "50",
        "--output-len",
        "300",
    ]));
    let mut sessions: BTreeMap<u64, Vec<&GeneratedRequest>> = BTreeMap::new();
    for r in &generated {
        if let Some((s, _)) = r.session {
            sessions.entry(s).or_default().push(r);
        }
    }
    let in_sessions = generated.iter().filter(|r| r.session.is_some()).count() as f64;
    let share = in_sessions / generated.len() as f64;
    assert!((share - 0.6).abs() < 0.05, "session share {share}");
    assert!(sessions.len() > 50);
    for turns in sessions.values() {
        assert!(turns.len() <= 3);
        for (k, pair) in turns.windows(2).enumerate() {
            let (prev, next) = (&pair[0].entry, &pair[1].entry);
            assert_eq!(pair[1].session.unwrap().1, k as u64 + 1, "turns in order");
            assert!(next.timestamp >= prev.timestamp);
            // The new prompt holds the previous prompt, its answer and a new message.
            assert_eq!(
                next.input_length,
                prev.input_length + prev.output_length + 50
            );
            assert_eq!(next.hash_ids[..prev.hash_ids.len()], prev.hash_ids[..]);
            assert_eq!(
                next.hash_ids.len() as u64,
                TraceEntry::max_blocks(next.input_length)
            );
        }
    }
    // Requests outside sessions share no blocks with anyone (no prefix groups).
    let mut owners: BTreeMap<u64, u64> = BTreeMap::new();
    for (i, r) in generated.iter().enumerate() {
        let owner = r.session.map_or(1_000_000 + i as u64, |(s, _)| s);
        for id in &r.entry.hash_ids {
            assert_eq!(
                *owners.entry(*id).or_insert(owner),
                owner,
                "block {id} shared across sessions"
            );
        }
    }
}

#[test]
fn arrivals_keep_the_rate_with_and_without_bursts() {
    for extra in [
        &[][..],
        &[
            "--burst-factor",
            "5",
            "--burst-period-s",
            "20",
            "--burst-fraction",
            "0.2",
        ][..],
    ] {
        let mut flags = vec![
            "--duration-s",
            "2000",
            "--request-rate",
            "5",
            "--input-len",
            "10",
        ];
        flags.extend_from_slice(extra);
        let generated = generate(&args(&flags));
        let rate = generated.len() as f64 / 2000.0;
        assert!((rate / 5.0 - 1.0).abs() < 0.05, "{extra:?}: rate {rate}");
        let last = generated.last().unwrap().entry.timestamp;
        assert!(
            last < 2_000_000.0 && last > 1_990_000.0,
            "last at {last} ms"
        );
        if extra.is_empty() {
            continue;
        }
        // Bursts: the first 4 s of every 20 s at 5x the rest's rate.
        let in_burst = generated
            .iter()
            .filter(|r| (r.entry.timestamp / 1e3) % 20.0 < 4.0)
            .count() as f64;
        let burst_rate = in_burst / (2000.0 * 0.2);
        let calm_rate = (generated.len() as f64 - in_burst) / (2000.0 * 0.8);
        assert!(
            (burst_rate / calm_rate - 5.0).abs() < 0.75,
            "{burst_rate} vs {calm_rate}"
        );
    }
}

#[test]
fn trace_gen_flags_are_checked() {
    for (flag, value) in [
        ("--session-share", "1.5"),
        ("--burst-factor", "0.5"),
        ("--burst-fraction", "1"),
        ("--prefix-zipf", "-1"),
        ("--request-rate", "0"),
        ("--duration-s", "0"),
    ] {
        // `--flag=value`, so that a negative value is not taken for a flag.
        let given = format!("{flag}={value}");
        let err = parse(&["trace-gen", "--output", "t", &given])
            .unwrap_err()
            .to_string();
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    assert!(parse(&["trace-gen"]).is_err(), "--output is required");
}
