//! `pdserve up` end to end: the real binary starts a prefill worker, a decode worker and
//! two gateway replicas, answers a chat request through each, and stops every process on
//! Ctrl-C (SIGINT).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

/// A free port whose next port is free too (for two gateway replicas).
fn free_port_pair() -> u16 {
    loop {
        let port = free_port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// A running `pdserve up`. Dropped before [`RunningUp::stop`] (a failed assertion), it is
/// stopped all the same, so no worker or gateway outlives the test.
struct RunningUp(std::process::Child);

impl RunningUp {
    fn id(&self) -> u32 {
        self.0.id()
    }

    /// Ctrl-C (SIGINT), then its exit status, or `None` if it has not exited in 30 s.
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        // SAFETY: signalling our own child process.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGINT);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.0.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Drop for RunningUp {
    fn drop(&mut self) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        let children = children_of(self.0.id());
        if self.stop().is_none() {
            for child in children {
                // SAFETY: signalling processes this test's `up` started.
                unsafe {
                    libc::kill(child as libc::pid_t, libc::SIGKILL);
                }
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `pdserve up --port P --cores 2 <extra>` once it printed its summary, and the summary's
/// worker lines.
fn start_up(port: u16, extra: &[&str]) -> (RunningUp, Vec<String>) {
    start_up_with(port, extra, &[])
}

/// [`start_up`] with `env` set for the stack.
fn start_up_with(port: u16, extra: &[&str], env: &[(&str, &str)]) -> (RunningUp, Vec<String>) {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let mut up = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["up", "--port", &port.to_string(), "--cores", "2"])
        .args(extra)
        .envs(env.iter().copied())
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map(RunningUp)
        .unwrap();
    let stdout = up.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut worker_lines = Vec::new();
    loop {
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(l) => l,
            Err(e) => panic!("pdserve up did not come up: {e}"),
        };
        if line.contains(" worker at ") {
            worker_lines.push(line.trim().to_string());
        }
        if line.starts_with("Ctrl-C stops everything") {
            break;
        }
    }
    (up, worker_lines)
}

/// `pdserve up` keeps history in SQLite under `$PDSERVE_HOME` by default: a conversation
/// and a stored response outlive the stack that made them.
#[test]
fn a_conversation_survives_restarting_the_stack() {
    let home = std::env::temp_dir().join(format!("pdserve-up-history-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let home_env = [("PDSERVE_HOME", home.to_str().unwrap())];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, url: String, body: Option<serde_json::Value>| {
        let request = http.request(method, url).timeout(Duration::from_secs(60));
        let request = match body {
            Some(body) => request.json(&body),
            None => request,
        };
        rt.block_on(async {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        })
    };
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let (mut up, _) = start_up_with(port, &["--aggregated"], &home_env);
    let (status, conversation) = call(
        reqwest::Method::POST,
        format!("{base}/v1/conversations"),
        Some(serde_json::json!({"items": [{"role": "user", "content": "Remember me."}]})),
    );
    assert_eq!(status, 200, "{conversation}");
    let (status, response) = call(
        reqwest::Method::POST,
        format!("{base}/v1/responses"),
        Some(serde_json::json!({"input": "Hi.", "max_output_tokens": 4, "temperature": 0})),
    );
    assert_eq!(status, 200, "{response}");
    assert!(up.stop().expect("up did not stop").success());
    assert!(
        home.join("history.sqlite").is_file(),
        "no history.sqlite in {home:?}"
    );

    let (mut up, _) = start_up_with(port, &["--aggregated"], &home_env);
    let conversation_id = conversation["id"].as_str().unwrap();
    let (status, items) = call(
        reqwest::Method::GET,
        format!("{base}/v1/conversations/{conversation_id}/items"),
        None,
    );
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["data"][0]["content"][0]["text"], "Remember me.");
    let response_id = response["id"].as_str().unwrap();
    let (status, stored) = call(
        reqwest::Method::GET,
        format!("{base}/v1/responses/{response_id}"),
        None,
    );
    assert_eq!(status, 200, "{stored}");
    assert_eq!(stored["output"], response["output"]);
    assert!(up.stop().expect("up did not stop").success());
    let _ = std::fs::remove_dir_all(&home);
}

/// The URL in a summary line "<role> worker at <url> on cores [..]".
fn url_of(line: &str) -> String {
    let at = line.find(" worker at ").unwrap();
    let rest = &line[at + " worker at ".len()..];
    rest.split(' ').next().unwrap().to_string()
}

#[test]
fn up_serves_through_the_gateway_and_stops_cleanly() {
    let port = free_port_pair();
    let (mut up, worker_lines) = start_up(port, &["--gateway-replicas", "2"]);
    let worker_urls: Vec<String> = worker_lines.iter().map(|l| url_of(l)).collect();
    // The default stack is disaggregated: one prefill and one decode worker.
    assert_eq!(worker_urls.len(), 2, "{worker_urls:?}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    for replica in [port, port + 1] {
        let body: serde_json::Value = rt.block_on(async {
            reqwest::Client::new()
                .post(format!("http://127.0.0.1:{replica}/v1/chat/completions"))
                .json(&serde_json::json!({
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                    "temperature": 0
                }))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        });
        let text = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!text.is_empty(), "{body}");
        assert!(body["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    }
    // Short prompts skip the prefill leg while the prefill worker is busy (the measured
    // default), on every replica.
    let gateways: Vec<String> = children_of(up.id())
        .into_iter()
        .map(|pid| process_facts(pid).0)
        .filter(|cmdline| cmdline.contains(" gateway "))
        .collect();
    assert_eq!(gateways.len(), 2, "{gateways:?}");
    for cmdline in &gateways {
        assert!(
            cmdline.contains("--disagg-threshold 512 --disagg-min-prefill-load 1"),
            "{cmdline}"
        );
    }
    // Every replica hears every worker's KV events (the workers bind ipc:// sockets in
    // the stack's private folder; each replica subscribes).
    for replica in [port, port + 1] {
        for url in &worker_urls {
            let series = format!(r#"pdserve_gateway_kv_events_total{{worker="{url}""#);
            let heard = (0..100).any(|_| {
                let text = rt.block_on(async {
                    reqwest::Client::new()
                        .get(format!("http://127.0.0.1:{replica}/metrics"))
                        .send()
                        .await
                        .unwrap()
                        .text()
                        .await
                        .unwrap()
                });
                let counted = text.lines().any(|l| l.starts_with(&series));
                if !counted {
                    std::thread::sleep(Duration::from_millis(100));
                }
                counted
            });
            assert!(heard, "replica {replica} counted no KV events of {url}");
        }
    }

    let status = up.stop().expect("up did not stop");
    assert!(status.success(), "{status}");
    // Its children are gone too: nothing answers on the workers' ports any more.
    let gateways = [port, port + 1].map(|p| format!("http://127.0.0.1:{p}"));
    for url in worker_urls.iter().chain(&gateways) {
        let alive = rt.block_on(async {
            reqwest::Client::new()
                .get(format!("{url}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok()
        });
        assert!(!alive, "{url} outlived pdserve up");
    }
}

/// The running children of `pid` (from every thread's `children` list).
fn children_of(pid: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path().join("children");
        let list = std::fs::read_to_string(path).unwrap_or_default();
        children.extend(list.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    children
}

/// A process's (command line, allowed CPUs, niceness), from /proc.
fn process_facts(pid: u32) -> (String, String, i64) {
    process_facts_at(&format!("/proc/{pid}")).unwrap()
}

/// (command line, allowed CPUs, niceness) of the process or thread at `dir` in /proc;
/// `None` once it has exited.
fn process_facts_at(dir: &str) -> Option<(String, String, i64)> {
    let cmdline = std::fs::read_to_string(format!("{dir}/cmdline"))
        .ok()?
        .replace('\0', " ");
    let status = std::fs::read_to_string(format!("{dir}/status")).ok()?;
    let cpus = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
        .trim()
        .to_string();
    // Field 19 of stat, counted after the parenthesised command name.
    let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let nice = after_name.split(' ').nth(16)?.parse().ok()?;
    Some((cmdline, cpus, nice))
}

#[test]
fn shared_core_layout_lends_the_decode_core_to_a_lower_priority_prefill_thread() {
    let port = free_port();
    let (mut up, worker_lines) = start_up(port, &["--core-layout", "shared"]);
    assert_eq!(worker_lines.len(), 2, "{worker_lines:?}");
    assert!(
        worker_lines[0].starts_with("prefill worker at ")
            && worker_lines[0].ends_with("on cores [0], borrowing [1] (one thread each, nice +10)"),
        "{worker_lines:?}"
    );
    assert!(
        worker_lines[1].starts_with("decode worker at ")
            && worker_lines[1].ends_with("on cores [1]"),
        "{worker_lines:?}"
    );
    // A prompt long enough to be prefilled by the prefill worker (`up` prefills shorter
    // ones on the decode worker) with its prefill matmuls' pool, which alone borrows.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let prompt = "word ".repeat(700);
    let status = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/v1/completions"))
            .json(&serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}))
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap()
            .status()
    });
    assert_eq!(status, 200);

    // What the kernel was told, not only what was printed.
    let mut seen = Vec::new();
    let mut prefill_threads = Vec::new();
    for child in children_of(up.id()) {
        let (cmdline, cpus, nice) = process_facts(child);
        if cmdline.contains("--role prefill") {
            assert!(
                cmdline.contains("--threads 2")
                    && cmdline.contains("--cpus 0")
                    && cmdline.contains("--borrowed-cpus 1"),
                "{cmdline}"
            );
            seen.push(("prefill", cpus, nice));
            prefill_threads = threads_of(child);
        } else if cmdline.contains("--role decode") {
            assert!(
                cmdline.contains("--threads 1") && !cmdline.contains("--borrowed-cpus"),
                "{cmdline}"
            );
            seen.push(("decode", cpus, nice));
        }
    }
    seen.sort();
    // Relative to `up`'s own niceness, which is this test's (CI may run under `nice`).
    let own = process_facts(std::process::id()).2;
    // Both workers compete with the rest of the machine at `up`'s own priority.
    assert_eq!(
        seen,
        vec![
            ("decode", "1".to_string(), own),
            ("prefill", "0".to_string(), own)
        ]
    );
    // Only the prefill's threads on the borrowed core run nicer, and none runs there at
    // its full priority.
    let lowered = (own + 10).min(19);
    assert!(
        prefill_threads.contains(&("1".to_string(), lowered)),
        "{prefill_threads:?}"
    );
    assert!(
        prefill_threads
            .iter()
            .all(|(cpus, nice)| (cpus == "0" && *nice == own) || (cpus == "1" && *nice == lowered)),
        "{prefill_threads:?}"
    );
    assert!(up.stop().is_some(), "up did not stop");
}

/// Each thread of `pid`: (allowed CPUs, niceness).
fn threads_of(pid: u32) -> Vec<(String, i64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| {
            let tid: u32 = task.ok()?.file_name().to_str()?.parse().ok()?;
            let (_, cpus, nice) = process_facts_at(&format!("/proc/{pid}/task/{tid}"))?;
            Some((cpus, nice))
        })
        .collect()
}
