//! `pdserve up --topology orchestrator` end to end: the real binary starts a prefill
//! worker and an orchestrating decode worker (no gateway) whose port is the public one,
//! answers a chat request through them (tokenized once, on the decode worker), and stops
//! both on Ctrl-C (SIGINT).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Prints the stack's log when the test fails, so a CI failure says why.
struct LogOnPanic(std::path::PathBuf);

impl Drop for LogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.0).unwrap_or_default();
            let tail: String = log
                .chars()
                .rev()
                .take(8000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            eprintln!("--- pdserve up stderr (tail) ---\n{tail}");
        }
        let _ = std::fs::remove_file(&self.0);
    }
}

const API_KEY: &str = "up-orchestrator-test-key";

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

#[test]
fn up_with_an_orchestrating_decode_worker_serves_and_stops_cleanly() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let port = free_port();
    let log_path = std::env::temp_dir().join(format!("pdserve-up-orchestrator-{port}.log"));
    let _log = LogOnPanic(log_path.clone());
    let mut up = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args([
            "up",
            "--topology",
            "orchestrator",
            "--handoff",
            "concurrent",
        ])
        .args(["--port", &port.to_string(), "--cores", "2"])
        // One key for both workers: the orchestrating decode worker must send it on its
        // prefill legs too.
        .args(["--api-key", API_KEY])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    loop {
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(l) => l,
            Err(e) => {
                let _ = up.kill();
                panic!("pdserve up did not come up: {e}; {lines:?}");
            }
        };
        if line.starts_with("Ctrl-C stops everything") {
            break;
        }
        lines.push(line);
    }
    let entry = format!("http://127.0.0.1:{port}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("is up at {entry}/v1"))),
        "{lines:?}"
    );
    let prefill_urls: Vec<String> = lines
        .iter()
        .filter_map(|l| l.trim().strip_prefix("prefill worker at "))
        .map(|rest| rest.split(' ').next().unwrap().to_string())
        .collect();
    assert_eq!(prefill_urls.len(), 1, "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("orchestrator, concurrent handoff")),
        "{lines:?}"
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let metric = |base: &str, name: &str| {
        let text = rt.block_on(async {
            let r = http.get(format!("{base}/metrics")).send().await.unwrap();
            r.text().await.unwrap()
        });
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} at {base}"))
    };
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0
    });
    let keyless = rt.block_on(async {
        http.post(format!("{entry}/v1/chat/completions"))
            .json(&chat)
            .send()
            .await
            .unwrap()
            .status()
    });
    assert_eq!(keyless.as_u16(), 401, "the OpenAI routes need --api-key");
    let body: serde_json::Value = rt.block_on(async {
        http.post(format!("{entry}/v1/chat/completions"))
            .bearer_auth(API_KEY)
            .json(&chat)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.is_empty(), "{body}");
    let tokenized = "pdserve_prompts_tokenized_total";
    assert_eq!(
        metric(&entry, tokenized),
        1.0,
        "tokenized on the decode worker"
    );
    assert_eq!(
        metric(&prefill_urls[0], tokenized),
        0.0,
        "never on the prefill"
    );
    assert!(metric(&entry, "pdserve_kv_transfer_imported_tokens_total") > 0.0);

    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "up did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status}");
    for url in [&entry, &prefill_urls[0]] {
        let alive = rt.block_on(async {
            http.get(format!("{url}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok()
        });
        assert!(!alive, "{url} outlived pdserve up");
    }
}
