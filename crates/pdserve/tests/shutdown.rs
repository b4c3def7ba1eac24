//! Graceful shutdown of real `pdserve` processes on 127.0.0.1: SIGTERM lets a worker's
//! open stream finish while new connections are turned away, then the worker exits 0;
//! SIGTERM on `pdserve up` stops every process it started and it exits 0. Each process
//! is killed by a guard if the test fails; every wait is bounded. Logs of the processes
//! are kept under the target's tmp dir.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Longest wait for a worker (or the whole `up` stack) to load the model and be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(240);

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

fn log_file(name: &str) -> (PathBuf, Stdio) {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("shutdown-{name}.log"));
    let file = std::fs::File::create(&path).unwrap();
    (path, Stdio::from(file))
}

fn sigterm(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is a process we started.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
}

/// Whether `pid` still runs (a zombie has exited; it only waits to be reaped).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(parent) {
            pids.push(pid);
        }
    }
    pids
}

/// A started process (and any of its children we learnt of) that is killed if the test
/// ends with it still running.
struct Guard {
    child: Child,
    log: PathBuf,
    descendants: Vec<u32>,
}

impl Guard {
    fn spawn(name: &str, args: &[&str]) -> Self {
        let (log, stderr) = log_file(name);
        let child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        Self {
            child,
            log,
            descendants: Vec::new(),
        }
    }

    /// Waits (bounded) for the process to exit.
    fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "pdserve did not exit within {limit:?} (log: {})",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        for &pid in &self.descendants {
            let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("pdserve"));
            if ours && alive(pid) {
                // SAFETY: as in `sigterm`; the pid was checked to be one of ours.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
        }
    }
}

/// Polls `/health` at `base` until it answers 200, failing early if the process exits.
async fn wait_healthy(guard: &mut Guard, base: &str) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = guard.child.try_wait().unwrap() {
            panic!(
                "exited before it was ready ({status}); log: {}",
                guard.log.display()
            );
        }
        if let Ok(resp) = http.get(format!("{base}/health")).send().await {
            if resp.status() == 200 {
                return;
            }
        }
        assert!(
            start.elapsed() < READY_TIMEOUT,
            "{base} never became healthy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a fresh connection to `port` gets.
#[derive(Debug, PartialEq)]
enum Fresh {
    /// Refused, or reset before any answer.
    NotServed,
    /// An HTTP answer with this status.
    Status(u16),
}

async fn fresh_health(port: u16) -> Fresh {
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return Fresh::NotServed;
    };
    let request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if conn.write_all(request.as_bytes()).await.is_err() {
        return Fresh::NotServed;
    }
    let mut head = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut head)).await;
    let head = String::from_utf8_lossy(&head);
    match (read, head.split_whitespace().nth(1)) {
        (Ok(_), Some(code)) => Fresh::Status(code.parse().unwrap()),
        (Ok(_), None) => Fresh::NotServed,
        (Err(_), _) => panic!("a fresh connection to {port} hung"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_worker_finish_its_stream_then_exit_0() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let port = free_port();
    let mut worker = Guard::spawn(
        "worker",
        &[
            "worker",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--model",
            &model.display().to_string(),
            "--threads",
            "1",
            "--num-kv-blocks",
            "128",
            "--shutdown-timeout",
            "120",
        ],
    );
    let base = format!("http://127.0.0.1:{port}");
    wait_healthy(&mut worker, &base).await;

    let max_tokens = 256;
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({
            "prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": true,
            "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
        }))
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp;
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    let mut text = String::from_utf8(first.to_vec()).unwrap();
    // The rest of the stream is read while the worker drains.
    let reader = tokio::spawn(async move {
        while let Some(chunk) = resp.chunk().await.expect("the stream breaks off cleanly") {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        (text, Instant::now())
    });

    sigterm(worker.child.id());
    let start = Instant::now();
    let turned_away_at = loop {
        match fresh_health(port).await {
            Fresh::NotServed | Fresh::Status(503) => break Instant::now(),
            Fresh::Status(200) => {}
            Fresh::Status(other) => panic!("a fresh /health got {other}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "new connections are still served 10 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    let (text, ended_at) = tokio::time::timeout(Duration::from_secs(180), reader)
        .await
        .expect("the stream ends")
        .unwrap();
    assert!(
        turned_away_at < ended_at,
        "the stream ended before the worker turned new connections away"
    );
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let events: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(events.iter().all(|e| e.get("error").is_none()), "{text}");
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");

    let status = worker.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}; log: {}", worker.log.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_pdserve_up_and_every_process_it_started() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let port = free_port();
    let mut up = Guard::spawn(
        "up",
        &[
            "up",
            "--port",
            &port.to_string(),
            "--cores",
            "2",
            "--shutdown-timeout",
            "10",
            "--model",
            &model.display().to_string(),
        ],
    );
    let stdout = up.child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut ports = vec![port];
    loop {
        let line = rx.recv_timeout(READY_TIMEOUT).unwrap_or_else(|e| {
            panic!(
                "pdserve up did not come up ({e}); log: {}",
                up.log.display()
            )
        });
        if let Some(at) = line.find(" worker at http://127.0.0.1:") {
            let rest = &line[at + " worker at http://127.0.0.1:".len()..];
            ports.push(rest.split(' ').next().unwrap().parse().unwrap());
        }
        if line.starts_with("Ctrl-C stops everything") {
            break;
        }
    }
    let children = children_of(up.child.id());
    up.descendants = children.clone();
    assert_eq!(children.len(), 3, "a gateway and two workers: {children:?}");
    assert_eq!(ports.len(), 3, "{ports:?}");

    sigterm(up.child.id());
    // Gateway, then workers: each within its shutdown timeout plus `up`'s margin.
    let status = up.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}; log: {}", up.log.display());
    for pid in children {
        let start = Instant::now();
        while alive(pid) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "process {pid} outlived pdserve up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for port in ports {
        assert_eq!(fresh_health(port).await, Fresh::NotServed, "port {port}");
    }
    // Each member drained and exited 0 by itself: `up` neither killed one nor saw one fail.
    let log = std::fs::read_to_string(&up.log).unwrap();
    assert!(
        !log.contains("exited with an error") && !log.contains("did not stop"),
        "{log}"
    );
}
