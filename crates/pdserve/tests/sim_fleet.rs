//! A simulated fleet, `pdserve up --sim`: eight sim workers (4 prefill + 4 decode) behind
//! the gateway with `up`'s defaults (KV events, the tokenizer, `precise_prefix`,
//! conditional disaggregation). Greedy or not, a sim worker's output is a function of the
//! token history, so P/D output (KV moved between processes over the real transfer
//! protocol) must equal one aggregated sim worker's, token for token.

use std::time::Duration;

use serde_json::{json, Value};

#[path = "support/up.rs"]
mod up;

use up::Up;

/// Fast steps: a fleet test that is about the path, not the timing.
const PROFILE: &str = "h100-llama-3.1-8b";

async fn metrics(url: &str) -> String {
    match reqwest::Client::new()
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
    {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// A metric's value summed over its series (0 when absent).
fn sum_of(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A completion's text and the worker headers that say where it ran.
async fn complete(entry: &str, prompt: &str, temperature: f64) -> (String, Option<String>) {
    let response = reqwest::Client::new()
        .post(format!("{entry}/v1/completions"))
        .json(&json!({
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": temperature,
        }))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let prefill = response
        .headers()
        .get("x-pdserve-prefill")
        .map(|v| v.to_str().unwrap().to_string());
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert!(status.is_success(), "{status}: {body}");
    assert_eq!(body["usage"]["completion_tokens"], 24, "{body}");
    (
        body["choices"][0]["text"].as_str().unwrap().to_string(),
        prefill,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sim_fleet_serves_pd_token_for_token_as_aggregated() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let pd = Up::start(
        &model,
        &[
            "--sim",
            PROFILE,
            "--prefill",
            "4",
            "--decode",
            "4",
            "--gateway-arg=--expose-routing",
        ],
    );
    assert_eq!(pd.workers.len(), 8, "{:?}", pd.workers);
    let aggregated = Up::start(&model, &["--sim", PROFILE, "--aggregated"]);

    // Long prompts (past --disagg-threshold 512) take the prefill leg and move their KV;
    // short ones may be prefilled on a decode worker. Both must match aggregated.
    let words = |n: usize, seed: usize| -> String {
        (0..n)
            .map(|i| ["alpha", "beta", "gamma", "delta", "river", "stone"][(i * 7 + seed) % 6])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut moved = 0;
    for (i, n) in [900, 40, 1500, 700, 12].into_iter().enumerate() {
        let prompt = words(n, i);
        for temperature in [0.0, 1.0] {
            let (want, _) = complete(&aggregated.entry, &prompt, temperature).await;
            let (got, prefill) = complete(&pd.entry, &prompt, temperature).await;
            assert_eq!(
                got, want,
                "prompt {i} ({n} words), temperature {temperature}"
            );
            moved += usize::from(prefill.is_some());
        }
    }
    assert!(moved >= 4, "only {moved} answers took the prefill leg");
    let mut imported = 0.0;
    for worker in &pd.workers {
        imported += sum_of(
            &metrics(worker).await,
            "pdserve_kv_transfer_imported_tokens_total",
        );
    }
    assert!(
        imported > 1000.0,
        "decode workers imported {imported} tokens"
    );
    // Every worker reports how well it kept the simulated time.
    for worker in &pd.workers {
        let text = metrics(worker).await;
        assert!(
            text.contains("pdserve_sim_step_lateness_seconds_bucket{le=\"0.005\"}"),
            "{worker}: no lateness histogram"
        );
    }
    aggregated.stop();

    // A shared-prefix trace with sessions and a burst, in Mooncake's format, replays with
    // no failure, and the fleet's prefix caches serve part of it.
    let dir = std::env::temp_dir().join(format!("pdserve-sim-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, result) = (dir.join("trace.jsonl"), dir.join("replay.json"));
    let bench = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .arg("bench")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pdserve bench {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    bench(&[
        "trace-gen",
        "--output",
        trace.to_str().unwrap(),
        "--duration-s",
        "20",
        "--request-rate",
        "3",
        "--prefix-groups",
        "4",
        "--prefix-blocks",
        "2",
        "--session-share",
        "0.3",
        "--burst-factor",
        "3",
        "--burst-period-s",
        "10",
        "--input-len",
        "300",
        "--output-len",
        "16",
        "--seed",
        "7",
    ]);
    let lines = std::fs::read_to_string(&trace).unwrap().lines().count() as u64;
    assert!(lines >= 30, "{lines} requests in the trace");
    bench(&[
        "serve",
        "--url",
        &pd.entry,
        "--dataset",
        "mooncake",
        "--dataset-path",
        trace.to_str().unwrap(),
        "--trace-speedup",
        "4",
        "--result-json",
        result.to_str().unwrap(),
    ]);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    let summary = &report["summary"];
    assert_eq!(summary["completed"], lines, "{summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    let cached = summary["cached_token_share"].as_f64().unwrap_or(0.0);
    assert!(cached > 0.1, "cached share {cached}: {summary}");
    let _ = std::fs::remove_dir_all(&dir);
    pd.stop();
}
