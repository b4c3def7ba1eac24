//! The official OpenAI Python SDK's Responses API (`client.responses.create`: plain,
//! streamed, a three-turn chain over `previous_response_id`, retrieve and delete, and the
//! errors it raises) against one aggregated worker (the oracle) and against `pdserve up`
//! in vLLM's P/D, aggregated, SGLang's P/D and decode-as-orchestrator. Every stack answers greedily with the
//! oracle's texts and token counts, and through P/D the second and third turns of the
//! chain report cached input tokens (the earlier turns' KV is reused). The script is
//! `tests/sdk/responses_sdk.py`; the Python interpreter is `$PDSERVE_TEST_PYTHON`, else
//! `python3`. Without the `openai` package the test skips, saying why, except under
//! `CI=true`, where it fails.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/up.rs"]
mod up;
#[path = "support/worker.rs"]
mod worker;

use up::Up;

/// The SDK script: `python responses_sdk.py BASE_URL` prints one JSON object.
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/responses_sdk.py");
/// Bounds one run of the script (it is killed past this).
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);
/// How to get an interpreter the test can use.
const INSTALL: &str = "python3 -m venv target/ci-venv && \
    target/ci-venv/bin/pip install 'openai>=1.66' && \
    export PDSERVE_TEST_PYTHON=$PWD/target/ci-venv/bin/python";

fn python() -> String {
    std::env::var("PDSERVE_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// A child Python without proxy settings: every request of the script is to 127.0.0.1.
fn python_command(python: &str) -> Command {
    let mut command = Command::new(python);
    for var in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        command.env_remove(var);
    }
    command.env("PYTHONDONTWRITEBYTECODE", "1");
    command
}

/// The installed SDK's version, or why `import openai` failed.
fn sdk_version(python: &str) -> Result<String, String> {
    let output = python_command(python)
        .args(["-c", "import openai; print(openai.__version__)"])
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(format!(
            "{python} cannot import openai: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Runs the script against `base` (`http://host:port`), bounded by [`SCRIPT_TIMEOUT`];
/// its JSON result.
fn run_script(python: &str, base: &str, what: &str) -> Value {
    let url = format!("{base}/v1");
    let mut child = python_command(python)
        .arg(SCRIPT)
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python} {SCRIPT}: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + SCRIPT_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let Some(status) = status else {
        panic!(
            "{what}: responses_sdk.py {url} ran past {SCRIPT_TIMEOUT:?} and was killed\n\
             stdout: {stdout}\nstderr: {stderr}"
        );
    };
    assert!(
        status.success(),
        "{what}: responses_sdk.py {url} failed ({status})\nstdout: {stdout}\nstderr: {stderr}"
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("{what}: responses_sdk.py printed no JSON object ({e}): {stdout}\nstderr: {stderr}")
    })
}

fn text(v: &Value) -> &str {
    v["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
}

fn count(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The stack's answers equal the oracle's: texts and token counts of the plain, streamed
/// and chained responses.
fn assert_same_answers(want: &Value, got: &Value, what: &str) {
    for part in ["plain", "stream"] {
        assert_eq!(text(&want[part]), text(&got[part]), "{what}: {part} text");
        for key in ["input_tokens", "output_tokens"] {
            assert_eq!(
                count(&want[part], key),
                count(&got[part], key),
                "{what}: {part} {key}"
            );
        }
    }
    let (want, got) = (
        want["chain"].as_array().unwrap(),
        got["chain"].as_array().unwrap(),
    );
    assert_eq!(want.len(), 3, "oracle chain: {want:?}");
    assert_eq!(got.len(), 3, "{what} chain: {got:?}");
    for (turn, (want, got)) in want.iter().zip(got).enumerate() {
        let turn = turn + 1;
        assert_eq!(text(want), text(got), "{what}: chain turn {turn} text");
        for key in ["input_tokens", "output_tokens"] {
            assert_eq!(
                count(want, key),
                count(got, key),
                "{what}: chain turn {turn} {key}"
            );
        }
    }
}

/// One row of the printed table: the chain's input and cached tokens per turn.
fn table_row(stack: &str, result: &Value) -> String {
    let turns: Vec<String> = result["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            format!(
                "{:>4} / {:<4}",
                count(t, "input_tokens"),
                count(t, "cached_tokens")
            )
        })
        .collect();
    format!("{stack:<32} {}", turns.join("  "))
}

#[test]
fn openai_sdk_responses_answer_alike_aggregated_and_through_p_d() {
    let python = python();
    let version = match sdk_version(&python) {
        Ok(version) => version,
        Err(why) => {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!(
                    "the OpenAI SDK test needs the `openai` Python package: {why}. \
                     Install it and point PDSERVE_TEST_PYTHON at that interpreter: {INSTALL}"
                );
            }
            eprintln!(
                "skipping the OpenAI SDK test: {why} (to run it: {INSTALL}; under CI=true \
                 this is a failure)"
            );
            return;
        }
    };
    eprintln!("OpenAI Python SDK {version} ({python})");
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();

    // The oracle: one aggregated worker.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (oracle, oracle_url) = rt.block_on(worker::start_worker(
        "prefill_decode",
        &model,
        &["--num-kv-blocks", "512"],
    ));
    let want = run_script(&python, &oracle_url, "aggregated worker");
    rt.block_on(oracle.shutdown()).unwrap();
    let mut table = vec![
        format!(
            "{:<32} {:<11}  {:<11}  {:<11}",
            "stack (input / cached tokens)", "turn 1", "turn 2", "turn 3"
        ),
        table_row("worker (oracle)", &want),
    ];

    for flags in [
        &[][..],
        &["--aggregated"][..],
        &["--protocol", "sglang"][..],
        // The decode worker is the entry point and runs its own prefill leg.
        &["--topology", "orchestrator"][..],
    ] {
        let what = format!("pdserve up {flags:?}");
        let up = Up::start(&model, flags);
        let got = run_script(&python, &up.entry, &what);
        assert_same_answers(&want, &got, &what);
        if !flags.contains(&"--aggregated") {
            for (turn, t) in got["chain"].as_array().unwrap().iter().enumerate().skip(1) {
                assert!(
                    count(t, "cached_tokens") > 0,
                    "{what}: chain turn {} reports no cached input tokens: {t}",
                    turn + 1
                );
            }
        }
        table.push(table_row(&what, &got));
        up.stop();
    }
    eprintln!("{}", table.join("\n"));
}
