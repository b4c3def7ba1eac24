//! Trace replay (`serve --dataset mooncake`): the reader's errors name the line and the
//! problem; requests go at their timestamps with prompts whose shared hash ids are
//! shared prefixes at the server; the report gives the bench's own send lateness.

mod support;

use std::path::PathBuf;

use pdserve_bench::serve::run_serve;
use pdserve_bench::trace::{read_trace, LineProblem, TraceError};
use pdserve_bench::{BenchCommand, BenchError};
use serde_json::Value;
use support::scripted_server::{Reply, ScriptedServer};
use support::{never, parse, scratch, serve_args, TEST_LIMIT};
use tokio::time::timeout;

fn write(name: &str, lines: &[&str]) -> PathBuf {
    let path = scratch(name);
    std::fs::write(&path, lines.join("\n") + "\n").expect("write trace");
    path
}

fn line(ts: u64, input: u64, output: u64, ids: &[u64]) -> String {
    format!(
        r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": {output}, "hash_ids": {ids:?}}}"#
    )
}

/// The error for a trace whose line 3 (after a good line and a blank one) is `bad`.
fn line_error(bad: &str) -> (usize, LineProblem, String) {
    let good = line(0, 10, 2, &[1]);
    let path = write("bad.jsonl", &[&good, "", bad, &good]);
    let err = read_trace(&path, None).unwrap_err();
    let text = err.to_string();
    match err {
        TraceError::Line { line, problem, .. } => (line, problem, text),
        other => panic!("{bad}: {other:?}"),
    }
}

#[test]
fn bad_lines_are_named_with_their_number_and_problem() {
    for (bad, expected) in [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (
            r#"{"timestamp": 5, "output_length": 2, "hash_ids": []}"#,
            "missing field `input_length`",
        ),
        (
            r#"{"timestamp": 5, "input_length": "ten", "output_length": 2, "hash_ids": []}"#,
            "field `input_length`: invalid type: string \"ten\"",
        ),
        (
            r#"{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1, "x"]}"#,
            "field `hash_ids`",
        ),
        (
            r#"{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": []}"#,
            "field `timestamp`",
        ),
        (
            &line(5, 1025, 2, &[1, 2, 3, 4]),
            "4 hash_ids are too many for input_length 1025: at most 3 blocks",
        ),
        (&line(5, 10, 0, &[]), "output_length is 0"),
        (&line(5, 0, 3, &[]), "input_length is 0"),
    ] {
        let (number, _, text) = line_error(bad);
        assert_eq!(number, 3, "{bad}: blank lines count in the numbering");
        assert!(
            text.contains("bad.jsonl line 3: ") && text.contains(expected),
            "{bad}: {text}"
        );
    }
    // The most blocks a prompt allows is fine, and extra fields are ignored.
    let ok = r#"{"timestamp": 5, "input_length": 1025, "output_length": 2, "hash_ids": [1, 2, 3], "session_id": "a"}"#;
    let path = write("ok.jsonl", &[ok]);
    assert_eq!(
        read_trace(&path, None).unwrap().entries[0].hash_ids,
        [1, 2, 3]
    );
    let (_, problem, _) = line_error("{not json");
    assert!(
        matches!(problem, LineProblem::NotJson(ref m) if m.contains("column")),
        "{problem:?}"
    );

    let empty = write("empty.jsonl", &["", "  "]);
    assert!(matches!(
        read_trace(&empty, None),
        Err(TraceError::Empty { .. })
    ));
    let missing = scratch("missing.jsonl");
    let err = read_trace(&missing, None).unwrap_err();
    assert!(matches!(err, TraceError::Io { .. }) && err.to_string().contains("missing.jsonl"));
}

#[test]
fn out_of_order_lines_are_sorted_stably_and_counted_and_num_prompts_reads_the_first() {
    let lines = [
        line(100, 10, 2, &[1]),
        line(50, 11, 2, &[]),
        line(100, 12, 2, &[]),
        line(20, 13, 2, &[]),
        line(300, 14, 2, &[]),
        "not read with a limit of 5".to_string(),
    ];
    let path = write(
        "order.jsonl",
        &lines.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let trace = read_trace(&path, Some(5)).expect("the bad 6th line is not read");
    assert_eq!(trace.out_of_order, 2, "the 50 and the 20");
    let inputs: Vec<u64> = trace.entries.iter().map(|e| e.input_length).collect();
    assert_eq!(
        inputs,
        [13, 11, 10, 12, 14],
        "stable: the two at 100 keep file order"
    );
    assert_eq!(read_trace(&path, Some(2)).unwrap().entries.len(), 2);
    assert!(
        read_trace(&path, None).is_err(),
        "without a limit line 6 is read"
    );
}

#[test]
fn trace_flags_refuse_closed_loop_pacing() {
    let url = "http://127.0.0.1:1";
    for (extra, expected) in [
        (
            &["--concurrency", "2"][..],
            "--concurrency cannot be used with --dataset mooncake",
        ),
        (
            &["--request-rate", "2"][..],
            "--request-rate cannot be used with --dataset mooncake",
        ),
    ] {
        let mut args = vec![
            "serve",
            "--url",
            url,
            "--dataset",
            "mooncake",
            "--dataset-path",
            "t.jsonl",
        ];
        args.extend_from_slice(extra);
        let err = parse(&args).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    let err = parse(&["serve", "--url", url, "--dataset", "mooncake"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--dataset-path"), "{err}");
    let ok = parse(&[
        "serve",
        "--url",
        url,
        "--dataset",
        "mooncake",
        "--dataset-path",
        "t.jsonl",
        "--trace-speedup",
        "4",
        "--num-prompts",
        "10",
    ]);
    assert!(
        matches!(ok, Ok(BenchCommand::Serve(ref a)) if a.num_prompts == Some(10)),
        "{ok:?}"
    );
}

#[tokio::test]
async fn a_bad_trace_stops_the_run_before_any_request() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(1, 1)).await;
    let path = write("stop.jsonl", &[&line(0, 10, 2, &[]), &line(5, 10, 0, &[])]);
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--dataset",
        "mooncake",
        "--dataset-path",
        path.to_str().unwrap(),
    ]);
    let err = run_serve(&args, never()).await.unwrap_err();
    assert!(
        matches!(err, BenchError::Trace(TraceError::Line { line: 2, .. })),
        "{err:?}"
    );
    assert!(server.requests().is_empty(), "nothing sent");
    server.stop().await;
}

fn prompt_words(body: &Value) -> Vec<String> {
    body["prompt"]
        .as_str()
        .expect("completion prompt")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn requests_go_at_their_timestamps_with_shared_blocks_shared() {
    // Timestamps in ms, one out of order; at speedup 2 the replay spans 0.35 s.
    let lines = [
        line(1000, 1100, 3, &[7, 8, 9]),
        line(1100, 1054, 4, &[7, 8, 10]),
        line(1200, 300, 2, &[8]),
        line(1150, 700, 5, &[11]),
        line(1400, 600, 3, &[7]),
        line(1700, 1024, 2, &[7, 8]),
    ];
    let path = write(
        "replay.jsonl",
        &lines.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let server = ScriptedServer::start_prefix_cached(|_| Reply::stream_ms(2, 1)).await;
    let url = server.url();
    let args = serve_args(&[
        "--url",
        &url,
        "--dataset",
        "mooncake",
        "--dataset-path",
        path.to_str().unwrap(),
        "--trace-speedup",
        "2",
    ]);
    let result = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    let bodies = server.requests();
    server.stop().await;
    assert_eq!(result.summary.completed, 6, "{:?}", result.failures);

    // Sorted: 1000, 1100, 1150, 1200, 1400, 1700 → planned 0, 50, 75, 100, 200, 350 ms.
    let planned = [0.0, 0.05, 0.075, 0.1, 0.2, 0.35];
    let inputs = [1100u64, 1054, 700, 300, 600, 1024];
    let outputs = [3u64, 4, 5, 2, 3, 2];
    for (i, r) in result.requests.iter().enumerate() {
        let scheduled = r.scheduled_s.expect("open loop");
        assert!(
            (scheduled - planned[i]).abs() < 1e-9,
            "request {i}: {scheduled}"
        );
        assert!(
            r.start_s >= scheduled && r.start_s <= scheduled + 0.1,
            "request {i}: {r:?}"
        );
        assert_eq!(
            (r.requested_prompt_tokens, r.requested_output_tokens),
            (inputs[i], outputs[i])
        );
    }
    let trace = result.config.trace.as_ref().expect("config.trace");
    assert_eq!((trace.speedup, trace.out_of_order), (2.0, 1));
    assert!((trace.span_s - 0.35).abs() < 1e-9);
    assert_eq!(result.config.num_requests, 6);
    assert_eq!(
        (result.config.concurrency, result.config.request_rate),
        (None, None)
    );
    let late = result.summary.send_lateness_ms.expect("lateness");
    assert!(late.min >= 0.0 && late.max < 100.0, "{late:?}");

    // The bodies (after the probe): max_tokens = output_length with ignore_eos, prompts
    // of input_length words (all distinct here), equal hash ids → equal words.
    let words_of = |n: u64| {
        let body = bodies[1..]
            .iter()
            .find(|b| prompt_words(b).len() as u64 == n)
            .expect("a prompt of every length");
        (
            body["max_tokens"].as_u64().unwrap(),
            body["ignore_eos"] == true,
            prompt_words(body),
        )
    };
    assert_eq!(bodies.len(), 7);
    for (i, &n) in inputs.iter().enumerate() {
        let (max_tokens, ignore_eos, _) = words_of(n);
        assert_eq!((max_tokens, ignore_eos), (outputs[i], true));
    }
    let (a, b, c, d) = (
        words_of(1100).2,
        words_of(1054).2,
        words_of(300).2,
        words_of(1024).2,
    );
    assert_eq!(a[..1024], b[..1024], "blocks 7, 8 shared");
    assert_ne!(a[1024..1054], b[1024..1054], "blocks 9 and 10 differ");
    assert_eq!(
        c[..],
        a[512..812],
        "block 8 cut short is a prefix of block 8"
    );
    assert_eq!(d[..], a[..1024], "blocks 7, 8 again");
    assert_ne!(words_of(700).2[..10], a[..10], "block 11 is new");

    // The server (an unbounded prefix cache) found what the trace says is reusable:
    // 1024 (request 2), 512 (block 7 then its own words), 1024 (blocks 7, 8); block 8
    // at the start of a prompt is not the prefix it was.
    let reusable = trace.reusable_token_share.expect("reusable share");
    let expected = (1024.0 + 512.0 + 1024.0) / inputs.iter().sum::<u64>() as f64;
    assert!(
        (reusable - expected).abs() < 1e-9,
        "{reusable} vs {expected}"
    );
    let cached = result.summary.cached_token_share.expect("cached share");
    assert!(
        cached >= reusable && cached < reusable + 0.01,
        "cached {cached} vs {reusable}"
    );

    let table = result.table();
    println!("{table}");
    for expected in [
        "trace at 2x",
        "Send Lateness",
        "P99 lateness (ms):",
        "Cached prompt-token share:",
        "Trace reusable prompt-token share:",
    ] {
        assert!(table.contains(expected), "{expected}: {table}");
    }
}
