//! The result file: a stable, documented key set; `--result-json` and `--plot` write
//! files; `compare` reads them back into a table and a plot.

mod support;

use std::collections::BTreeSet;

use pdserve_bench::compare::{run_compare, table};
use pdserve_bench::multi_turn::run_multi_turn;
use pdserve_bench::serve::run_serve;
use pdserve_bench::{BenchResult, CompareArgs, SCHEMA_VERSION};
use serde_json::Value;
use support::scripted_server::{Reply, ScriptedServer};
use support::{multi_turn_args, never, scratch, serve_args, TEST_LIMIT};
use tokio::time::timeout;

/// Every key path of a result file (`[]` marks array elements). Changing this list
/// means changing the schema: update the README, and bump `SCHEMA_VERSION` unless the
/// change only adds keys that may be absent (older files then still parse).
const GOLDEN_KEYS: &[&str] = &[
    "config",
    "config.api",
    "config.concurrency",
    "config.conversations",
    "config.dataset",
    "config.endpoint",
    "config.ignore_eos",
    "config.input_len",
    "config.model",
    "config.num_requests",
    "config.output_len",
    "config.priorities",
    "config.priorities[].share",
    "config.priorities[].value",
    "config.range_ratio",
    "config.request_rate",
    "config.seed",
    "config.send_conversation_id",
    "config.shared_prefix",
    "config.system_prompt_len",
    "config.trace",
    "config.trace.out_of_order",
    "config.trace.path",
    "config.trace.reusable_token_share",
    "config.trace.span_s",
    "config.trace.speedup",
    "config.slo_tpot_ms",
    "config.slo_ttft_ms",
    "config.turn_input_len",
    "config.turns",
    "config.url",
    "config.urls",
    "failures",
    "failures[].count",
    "failures[].reason",
    "interrupted",
    "kind",
    "label",
    "per_priority",
    "per_priority[].completed",
    "per_priority[].e2e_ms",
    "per_priority[].e2e_ms.max",
    "per_priority[].e2e_ms.mean",
    "per_priority[].e2e_ms.min",
    "per_priority[].e2e_ms.p50",
    "per_priority[].e2e_ms.p90",
    "per_priority[].e2e_ms.p99",
    "per_priority[].failed",
    "per_priority[].priority",
    "per_priority[].rejected_408",
    "per_priority[].rejected_429",
    "per_priority[].ttft_ms",
    "per_priority[].ttft_ms.max",
    "per_priority[].ttft_ms.mean",
    "per_priority[].ttft_ms.min",
    "per_priority[].ttft_ms.p50",
    "per_priority[].ttft_ms.p90",
    "per_priority[].ttft_ms.p99",
    "requests",
    "requests[].cached_tokens",
    "requests[].conversation",
    "requests[].e2e_ms",
    "requests[].error",
    "requests[].http_status",
    "requests[].index",
    "requests[].itl_ms",
    "requests[].ok",
    "requests[].output_tokens",
    "requests[].priority",
    "requests[].prompt_tokens",
    "requests[].requested_output_tokens",
    "requests[].requested_prompt_tokens",
    "requests[].scheduled_s",
    "requests[].start_s",
    "requests[].tpot_ms",
    "requests[].ttft_ms",
    "requests[].turn",
    "schema_version",
    "started_at_unix_s",
    "summary",
    "summary.cached_token_share",
    "summary.completed",
    "summary.duration_s",
    "summary.e2e_ms",
    "summary.e2e_ms.max",
    "summary.e2e_ms.mean",
    "summary.e2e_ms.min",
    "summary.e2e_ms.p50",
    "summary.e2e_ms.p90",
    "summary.e2e_ms.p99",
    "summary.failed",
    "summary.good_requests",
    "summary.goodput",
    "summary.itl_ms",
    "summary.itl_ms.max",
    "summary.itl_ms.mean",
    "summary.itl_ms.min",
    "summary.itl_ms.p50",
    "summary.itl_ms.p90",
    "summary.itl_ms.p99",
    "summary.not_finished",
    "summary.output_throughput",
    "summary.request_throughput",
    "summary.send_lateness_ms",
    "summary.send_lateness_ms.max",
    "summary.send_lateness_ms.mean",
    "summary.send_lateness_ms.min",
    "summary.send_lateness_ms.p50",
    "summary.send_lateness_ms.p90",
    "summary.send_lateness_ms.p99",
    "summary.total_input_tokens",
    "summary.total_output_tokens",
    "summary.total_token_throughput",
    "summary.tpot_ms",
    "summary.tpot_ms.max",
    "summary.tpot_ms.mean",
    "summary.tpot_ms.min",
    "summary.tpot_ms.p50",
    "summary.tpot_ms.p90",
    "summary.tpot_ms.p99",
    "summary.ttft_ms",
    "summary.ttft_ms.max",
    "summary.ttft_ms.mean",
    "summary.ttft_ms.min",
    "summary.ttft_ms.p50",
    "summary.ttft_ms.p90",
    "summary.ttft_ms.p99",
    "tool",
    "turns",
    "turns[].cached_token_share",
    "turns[].completed",
    "turns[].failed",
    "turns[].mean_prompt_tokens",
    "turns[].ttft_ms",
    "turns[].ttft_ms.max",
    "turns[].ttft_ms.mean",
    "turns[].ttft_ms.min",
    "turns[].ttft_ms.p50",
    "turns[].ttft_ms.p90",
    "turns[].ttft_ms.p99",
    "turns[].turn",
];

fn key_paths(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(path.clone());
                key_paths(v, &path, out);
            }
        }
        Value::Array(items) => {
            for item in items.iter().filter(|i| i.is_object()) {
                key_paths(item, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// Equal JSON, floats to 1e-9 relative (serde_json may parse a float one ulp off).
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0)
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// `--dataset shared-prefix` over two `--url`s: every request sent, alternately, each a
/// group's system prompt plus its own question.
#[tokio::test]
async fn shared_prefix_requests_spread_over_repeated_urls() {
    let (a, b) = (
        ScriptedServer::start(|_| Reply::stream_ms(1, 1)).await,
        ScriptedServer::start(|_| Reply::stream_ms(1, 1)).await,
    );
    let (url_a, url_b) = (a.url(), b.url());
    let flags = [
        "--url",
        url_a.as_str(),
        "--url",
        url_b.as_str(),
        "--concurrency",
        "2",
        "--dataset",
        "shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "20",
        "--gsp-question-len",
        "4",
        "--gsp-output-len",
        "2",
    ];
    let result = timeout(TEST_LIMIT, run_serve(&serve_args(&flags), never()))
        .await
        .expect("bounded")
        .expect("run");
    assert_eq!(result.config.num_requests, 6);
    assert_eq!(result.summary.completed, 6);
    assert_eq!(result.config.urls, vec![url_a.clone(), url_b.clone()]);
    let shape = result.config.shared_prefix.expect("recorded");
    assert_eq!(
        (
            shape.groups,
            shape.prompts_per_group,
            shape.system_prompt_len
        ),
        (2, 3, 20)
    );
    // The probe, then half the requests each.
    let (sent_a, sent_b) = (a.requests(), b.requests());
    assert_eq!((sent_a.len(), sent_b.len()), (1 + 3, 1 + 3));
    let prefixes: BTreeSet<String> = sent_a[1..]
        .iter()
        .chain(&sent_b[1..])
        .map(|r| {
            let prompt = r["prompt"].as_str().unwrap();
            prompt.split(' ').take(21).collect::<Vec<_>>().join(" ")
        })
        .collect();
    assert_eq!(prefixes.len(), 2, "two groups' system prompts");
    a.stop().await;
    b.stop().await;
}

async fn serve_result(server: &ScriptedServer, extra: &[&str]) -> BenchResult {
    let url = server.url();
    let mut flags = vec![
        "--url",
        url.as_str(),
        "--num-prompts",
        "6",
        "--output-len",
        "3",
        "--input-len",
        "5",
    ];
    flags.extend_from_slice(extra);
    timeout(TEST_LIMIT, run_serve(&serve_args(&flags), never()))
        .await
        .expect("bounded")
        .expect("run")
}

#[tokio::test]
async fn result_file_keys_are_stable_and_documented() {
    let server = ScriptedServer::start(|n| {
        if n == 0 {
            Reply::Error {
                status: 429,
                message: "slow down".into(),
            }
        } else {
            Reply::stream_ms(2, 2)
        }
    })
    .await;
    let serve = serve_result(&server, &["--concurrency", "2", "--slo-ttft-ms", "1000"]).await;
    let prioritized = serve_result(&server, &["--concurrency", "2", "--priority", "1:0.5"]).await;
    let rate = serve_result(&server, &["--request-rate", "200"]).await;
    let trace_path = scratch("golden-trace.jsonl");
    std::fs::write(
        &trace_path,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 20, \"input_length\": 520, \"output_length\": 3, \"hash_ids\": [0]}\n",
    )
    .expect("write trace");
    let url = server.url();
    let replay = serve_args(&[
        "--url",
        &url,
        "--dataset",
        "mooncake",
        "--dataset-path",
        trace_path.to_str().unwrap(),
    ]);
    let replayed = timeout(TEST_LIMIT, run_serve(&replay, never()))
        .await
        .expect("bounded")
        .expect("run");
    let url = server.url();
    let args = multi_turn_args(&[
        "--url",
        &url,
        "--conversations",
        "2",
        "--turns",
        "2",
        "--output-len",
        "2",
    ]);
    let multi = timeout(TEST_LIMIT, run_multi_turn(&args, never()))
        .await
        .expect("bounded")
        .expect("run");
    server.stop().await;

    let mut keys = BTreeSet::new();
    for result in [&serve, &prioritized, &rate, &replayed, &multi] {
        assert_eq!(result.schema_version, SCHEMA_VERSION);
        key_paths(&serde_json::to_value(result).expect("json"), "", &mut keys);
    }
    let golden: BTreeSet<String> = GOLDEN_KEYS.iter().map(|k| k.to_string()).collect();
    let added: Vec<_> = keys.difference(&golden).collect();
    let removed: Vec<_> = golden.difference(&keys).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "schema changed: added {added:?}, removed {removed:?}"
    );

    // Every key is documented in the README (distribution fields once, generically).
    let readme = include_str!("../README.md");
    for key in GOLDEN_KEYS {
        let documented = match key.rsplit_once('.') {
            Some((parent, field)) if parent.ends_with("_ms") && !key.starts_with("requests") => {
                readme.contains(&format!("`{parent}`")) && readme.contains(&format!("`{field}`"))
            }
            _ => readme.contains(&format!("`{key}`")),
        };
        assert!(
            documented,
            "{key} is not documented in crates/bench/README.md"
        );
    }

    // The file round-trips.
    let path = scratch("roundtrip.json");
    serve.write_json(&path).expect("write");
    let back = serde_json::to_value(BenchResult::read_json(&path).expect("read")).unwrap();
    assert!(
        same_json(&back, &serde_json::to_value(&serve).unwrap()),
        "round trip"
    );

    // The priority keys appear only with `--priority`, so files without them (older
    // ones included) are the same schema and still parse.
    let plain = serde_json::to_value(&serve).unwrap();
    assert!(plain.get("per_priority").is_none() && plain["config"].get("priorities").is_none());
    assert!(
        plain["config"].get("trace").is_none(),
        "config.trace only for a trace"
    );
    // Files from before --priority and lateness, without their keys, still parse.
    let mut old = plain.clone();
    for request in old["requests"].as_array_mut().unwrap() {
        let request = request.as_object_mut().unwrap();
        request.remove("priority");
        request.remove("http_status");
        request.remove("scheduled_s");
    }
    old["summary"]
        .as_object_mut()
        .unwrap()
        .remove("send_lateness_ms");
    std::fs::write(&path, old.to_string()).expect("write");
    let back = BenchResult::read_json(&path).expect("a file from before --priority");
    assert!(back.per_priority.is_empty() && back.config.priorities.is_empty());
    assert_eq!(back.requests[0].http_status, None);
    // The first to arrive was answered 429, which its record keeps.
    let statuses: Vec<_> = serve
        .requests
        .iter()
        .filter_map(|r| r.http_status)
        .collect();
    assert_eq!(statuses, [429]);
    let path = scratch("roundtrip-priority.json");
    prioritized.write_json(&path).expect("write");
    let back = BenchResult::read_json(&path).expect("read");
    assert!(
        same_json(
            &serde_json::to_value(&back).unwrap(),
            &serde_json::to_value(&prioritized).unwrap()
        ),
        "round trip with --priority"
    );
    assert!(!back.per_priority.is_empty());
    let path = scratch("roundtrip-trace.json");
    replayed.write_json(&path).expect("write");
    let back = BenchResult::read_json(&path).expect("read");
    assert!(
        same_json(
            &serde_json::to_value(&back).unwrap(),
            &serde_json::to_value(&replayed).unwrap()
        ),
        "round trip of a trace replay"
    );
    assert_eq!(back.config.trace.as_ref().map(|t| t.speedup), Some(1.0));

    std::fs::write(&path, r#"{"schema_version": 999}"#).expect("write");
    let err = BenchResult::read_json(&path).unwrap_err().to_string();
    assert!(err.contains("schema version 999"), "{err}");
}

#[tokio::test]
async fn serve_writes_json_and_plot_and_compare_reads_them() {
    let server = ScriptedServer::start(|_| Reply::stream_ms(5, 3)).await;
    let url = server.url();
    let (json_a, json_b, plot_a, plot_cmp) = (
        scratch("a.json"),
        scratch("b.json"),
        scratch("a.svg"),
        scratch("compare.svg"),
    );
    for (json, label, conc, plot) in [
        (&json_a, "one", "1", Some(&plot_a)),
        (&json_b, "four", "4", None),
    ] {
        let mut flags = vec![
            "serve",
            "--url",
            url.as_str(),
            "--num-prompts",
            "8",
            "--output-len",
            "4",
            "--concurrency",
            conc,
            "--label",
            label,
            "--result-json",
            json.to_str().unwrap(),
        ];
        if let Some(plot) = plot {
            flags.extend(["--plot", plot.to_str().unwrap()]);
        }
        let args = match support::parse(&flags).expect("flags") {
            pdserve_bench::BenchCommand::Serve(a) => a,
            _ => unreachable!(),
        };
        let result = timeout(TEST_LIMIT, run_serve(&args, never()))
            .await
            .expect("bounded")
            .expect("run");
        pdserve_bench::emit(&result, &args.output).expect("emit");
    }
    server.stop().await;
    let svg = std::fs::read_to_string(&plot_a).expect("serve plot written");
    assert!(
        svg.starts_with("<svg") && svg.contains("Time to first token"),
        "{}",
        &svg[..svg.len().min(200)]
    );

    let runs = [
        BenchResult::read_json(&json_a).unwrap(),
        BenchResult::read_json(&json_b).unwrap(),
    ];
    let text = table(&runs);
    assert!(
        text.lines().next().unwrap().contains("one") && text.contains("four"),
        "{text}"
    );
    let ratio_row = text
        .lines()
        .find(|l| l.starts_with("Request throughput"))
        .expect("row");
    assert!(
        ratio_row.contains('x'),
        "ratios against the first run: {ratio_row}"
    );
    assert!(text.contains("P99 TTFT (ms)"));

    run_compare(&CompareArgs {
        files: vec![json_a, json_b],
        plot: Some(plot_cmp.clone()),
    })
    .expect("compare");
    let svg = std::fs::read_to_string(&plot_cmp).expect("compare plot written");
    assert!(svg.contains("one") && svg.contains("four") && svg.contains("Output throughput"));
}

#[test]
fn compare_rejects_files_that_are_not_results() {
    let path = scratch("not-a-result.json");
    std::fs::write(&path, "{\"hello\": 1}").unwrap();
    let err = run_compare(&CompareArgs {
        files: vec![path],
        plot: None,
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("not a pdserve bench result"),
        "{err}"
    );
}
