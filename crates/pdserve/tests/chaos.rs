//! Chaos under load: real `pdserve` processes on 127.0.0.1 serve a steady mix of greedy
//! requests (chat and completions, streamed and not, `conversation_id` multi-turn) while
//! faults are injected at random: SIGSTOP/SIGCONT of a worker, SIGKILL and restart on
//! the same port or on a new one (announced through the discovery file), a KV-transfer
//! connection cut mid-transfer (a loopback TCP proxy between the workers' KV ports), a
//! gateway replica killed and restarted, a KV-event publisher restarted, the discovery
//! file rewritten. Four topologies run in turn: vLLM-protocol P/D (2 prefill, 1 decode),
//! SGLang bootstrap, decode as orchestrator, two gateway replicas on one discovery file.
//!
//! Invariants, checked on every run: every request ends within its deadline; every
//! stream ends with `[DONE]` or an OpenAI error event, never cut silently; every
//! completed answer equals the aggregated worker's greedy answer; no gateway or worker
//! dies on its own; after the load every worker is back to 0 blocks used or pinned
//! within `--kv-abort-timeout` and every gateway has 0 requests in flight; within 5 s of
//! a restarted process answering its health, requests through it succeed again.
//!
//! The short form (default, part of `cargo test --workspace`) gives every topology a few
//! dozen seconds. The long form runs by hand for as many seconds as asked:
//!
//! ```text
//! PDSERVE_CHAOS_SECS=900 cargo test -p pdserve --test chaos --release -- --nocapture
//! ```
//!
//! The seed is printed; `PDSERVE_CHAOS_SEED=<seed>` replays the same faults and request
//! mix (timing still varies). A JSON summary is written to
//! `target/tmp/chaos-summary.json`; each process's log to `target/tmp/chaos-<seed>/`.

#[path = "support/http1.rs"]
mod http1;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use http1::read_request;

/// How long one request may take at most, retries and stalls included.
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// Workers free unread KV this long after it was published (`--kv-abort-timeout`).
const KV_ABORT_TIMEOUT_SECS: u64 = 4;
/// A restarted process answers its health; requests through it succeed within this.
const RECOVERY_BOUND: Duration = Duration::from_secs(5);
/// Tokens per answer: small, so two cores keep up with the load.
const MAX_TOKENS: u32 = 8;
/// Concurrent clients.
const CLIENTS: usize = 4;

// ---------------------------------------------------------------------------------------
// Seeded randomness.

/// SplitMix64: small, seedable, good enough to pick faults and requests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn secs(&mut self, lo: f64, hi: f64) -> Duration {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        Duration::from_secs_f64(lo + (hi - lo) * unit)
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Processes.

fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

/// The `pdserve` binary every process of the run starts from: a private copy, taken
/// once at the start, so that a build that replaces `target/*/pdserve` meanwhile (a
/// target directory shared between checkouts) cannot mix versions within a run.
static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn pin_binary(dir: &Path) {
    let copy = dir.join("pdserve");
    std::fs::copy(env!("CARGO_BIN_EXE_pdserve"), &copy).unwrap();
    BINARY.set(copy).unwrap();
}

/// A `pdserve` child in its own process group, SIGKILLed (group and all) when dropped.
struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    fn spawn(name: &str, args: &[String], log: &Path) -> Self {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new(BINARY.get().expect("pin_binary first"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Self {
            child,
            name: name.to_string(),
        }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: signalling our own child process.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, signal);
        }
    }

    /// `Some(status)` when it exited.
    fn exited(&mut self) -> Option<String> {
        self.child.try_wait().unwrap().map(|s| s.to_string())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: signalling our own child's process group (it leads it).
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// Waits until `GET {base}/health` answers 200; the instant it did. Panics (naming the
/// log) when `proc` exits first or `limit` passes.
async fn wait_healthy(
    http: &reqwest::Client,
    base: &str,
    proc: &mut Proc,
    limit: Duration,
) -> Instant {
    let started = Instant::now();
    loop {
        if let Some(status) = proc.exited() {
            panic!("{} exited while starting ({status})", proc.name);
        }
        let probe = http
            .get(format!("{base}/health"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if probe.is_ok_and(|r| r.status() == 200) {
            return Instant::now();
        }
        assert!(
            started.elapsed() < limit,
            "{} at {base} not healthy within {limit:?}",
            proc.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// The KV-transfer proxy and the prefill relay that points decode workers at it.

/// A loopback TCP proxy in front of a worker's KV port. While armed, every connection
/// that carries data from the worker is cut mid-transfer: half the chunk goes through,
/// then both sides are closed.
struct KvProxy {
    port: u16,
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl KvProxy {
    async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicU64::new(0));
        let (a, c) = (armed.clone(), cuts.clone());
        let task = tokio::spawn(async move {
            let mut pumps = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        pumps.spawn(pump(client, target, a.clone(), c.clone()));
                    }
                    Some(_) = pumps.join_next(), if !pumps.is_empty() => {}
                }
            }
        });
        Self {
            port,
            armed,
            cuts,
            task,
        }
    }
}

impl Drop for KvProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(mut client: TcpStream, target: u16, armed: Arc<AtomicBool>, cuts: Arc<AtomicU64>) {
    let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let (mut cr, mut cw) = client.split();
    let (mut ur, mut uw) = upstream.split();
    let (mut a, mut b) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let mut client_open = true;
    loop {
        tokio::select! {
            read = cr.read(&mut a), if client_open => match read {
                Ok(0) | Err(_) => {
                    client_open = false;
                    let _ = uw.shutdown().await;
                }
                Ok(n) => {
                    if uw.write_all(&a[..n]).await.is_err() {
                        return;
                    }
                }
            },
            read = ur.read(&mut b) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if armed.load(Ordering::SeqCst) {
                        let _ = cw.write_all(&b[..n / 2]).await;
                        cuts.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    if cw.write_all(&b[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}

/// An HTTP/1.1 relay in front of a prefill worker: forwards every request and answers
/// with the worker's answer, its `"remote_port":KV` rewritten to the KV proxy's port, so
/// decode workers pull that prefill worker's KV through the proxy.
struct Relay {
    port: u16,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: String, kv_port: u16, proxy_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let http = reqwest::Client::builder().no_proxy().build().unwrap();
            let from = format!("\"remote_port\":{kv_port}");
            let to = format!("\"remote_port\":{proxy_port}");
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((socket, _)) = accepted else { continue };
                        let rewrite = (from.clone(), to.clone());
                        conns.spawn(relay(socket, http.clone(), upstream.clone(), rewrite));
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Self { port, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    mut socket: TcpStream,
    http: reqwest::Client,
    upstream: String,
    rewrite: (String, String),
) {
    let Some((head, body)) = read_request(&mut socket).await else {
        return;
    };
    let mut lines = head.lines();
    let mut request_line = lines.next().unwrap_or_default().split(' ');
    let (Some(method), Some(path)) = (request_line.next(), request_line.next()) else {
        return;
    };
    let Ok(method) = reqwest::Method::from_bytes(method.as_bytes()) else {
        return;
    };
    let mut request = http.request(method, format!("{upstream}{path}")).body(body);
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            let skip = ["host", "content-length", "connection", "transfer-encoding"];
            if !skip.iter().any(|s| name.trim().eq_ignore_ascii_case(s)) {
                request = request.header(name.trim(), value.trim());
            }
        }
    }
    let Ok(mut answer) = request.send().await else {
        let head = "HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        let _ = socket.write_all(head.as_bytes()).await;
        return;
    };
    let status = answer.status().as_u16();
    let content_type = answer
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/octet-stream")
        .to_string();
    if content_type.starts_with("text/event-stream") {
        // Streamed: relayed as it comes, the end of the body marked by closing.
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n\r\n"
        );
        if socket.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        while let Ok(Some(chunk)) = answer.chunk().await {
            if socket.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = socket.shutdown().await;
        return;
    }
    let Ok(bytes) = answer.bytes().await else {
        return;
    };
    let body = String::from_utf8_lossy(&bytes).replace(&rewrite.0, &rewrite.1);
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(body.as_bytes()).await;
    let _ = socket.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// Requests and their references.

const LONG: &str = "The history of the printing press begins in the fifteenth century, when \
                    Johannes Gutenberg combined movable metal type with oil-based ink and a \
                    screw press. Explain in one sentence why this mattered";

const CHATS: &[&str] = &[
    "Name a color.",
    "What is the capital of France?",
    "Say hello to a friend.",
    "Count from one to five.",
    LONG,
];
const COMPLETIONS: &[&str] = &[
    "Once upon a time",
    "The quick brown fox",
    "In the year 1492,",
    LONG,
];
const CONVERSATIONS: &[(&str, &str)] = &[
    ("Name a fruit.", "And a vegetable?"),
    ("Pick a number between one and ten.", "Now double it."),
    (LONG, "Say it again, shorter."),
];

fn chat_body(messages: Value, stream: bool) -> Value {
    json!({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
}

fn completion_body(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

/// The aggregated worker's greedy answers to everything the clients send.
struct Catalog {
    chats: Vec<String>,
    completions: Vec<String>,
    /// (turn 1, turn 2) per conversation.
    conversations: Vec<(String, String)>,
}

impl Catalog {
    async fn compute(http: &reqwest::Client, base: &str) -> Self {
        let ask = |path: &'static str, body: Value| async move {
            let response = http
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "reference {path} {body}");
            let value: Value = response.json().await.unwrap();
            text_of(&value).unwrap()
        };
        let mut chats = Vec::new();
        for c in CHATS {
            chats.push(ask("/v1/chat/completions", chat_body(json!([user(c)]), false)).await);
        }
        let mut completions = Vec::new();
        for p in COMPLETIONS {
            completions.push(ask("/v1/completions", completion_body(p, false)).await);
        }
        let mut conversations = Vec::new();
        for (first, second) in CONVERSATIONS {
            let a1 = ask(
                "/v1/chat/completions",
                chat_body(json!([user(first)]), false),
            )
            .await;
            let turn2 = json!([user(first), {"role": "assistant", "content": a1}, user(second)]);
            let a2 = ask("/v1/chat/completions", chat_body(turn2, false)).await;
            conversations.push((a1, a2));
        }
        Self {
            chats,
            completions,
            conversations,
        }
    }
}

fn text_of(v: &Value) -> Option<String> {
    let choice = &v["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .map(str::to_string)
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Answered, and the answer equals the reference.
    Ok,
    /// An HTTP error, an OpenAI error event, a refused or reset connection to a process
    /// that a fault killed: an honest failure.
    Failed,
    /// A stream that ended without `[DONE]` and without an error event.
    Cut,
    /// Past its deadline.
    Hung,
    /// Answered, but not the reference answer.
    Wrong,
}

/// What one request did.
#[derive(Debug, Clone)]
struct Record {
    /// chat, chat_stream, completion, completion_stream, conversation, conversation_stream.
    kind: &'static str,
    start: f64,
    end: f64,
    outcome: Outcome,
    /// For a failure: whether sending it again at once succeeded.
    retry_saved: Option<bool>,
    detail: String,
}

/// Sends `body` to `url` and reads the whole answer within the deadline: the answer's
/// text, or how it failed.
async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<String, (Outcome, String)> {
    let stream = body["stream"] == json!(true);
    let attempt = async {
        let response = http
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(|e| (Outcome::Failed, format!("send: {e}")))?;
        let status = response.status().as_u16();
        if status != 200 {
            let text = response.text().await.unwrap_or_default();
            return Err((Outcome::Failed, format!("{status}: {text}")));
        }
        if !stream {
            let text = response
                .text()
                .await
                .map_err(|e| (Outcome::Failed, format!("body: {e}")))?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| (Outcome::Failed, format!("bad JSON ({e}): {text}")))?;
            return text_of(&value).ok_or((Outcome::Failed, format!("no text: {text}")));
        }
        let mut response = response;
        let mut raw = Vec::new();
        let mut broken = None;
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => raw.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(e) => {
                    broken = Some(e.to_string());
                    break;
                }
            }
        }
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let mut text = String::new();
        let mut done = false;
        for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                return Err((Outcome::Cut, format!("unparsable event {data:?}")));
            };
            if chunk.get("error").is_some() {
                return Err((Outcome::Failed, format!("error event: {data}")));
            }
            if let Some(choice) = chunk["choices"].get(0) {
                if let Some(t) = choice["delta"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
                {
                    text.push_str(t);
                }
            }
        }
        match (done, broken) {
            (true, _) => Ok(text),
            (false, Some(e)) => Err((
                Outcome::Cut,
                format!("stream broke without an error event: {e}"),
            )),
            (false, None) => Err((
                Outcome::Cut,
                format!("stream ended without [DONE]: {raw:?}"),
            )),
        }
    };
    match tokio::time::timeout(REQUEST_DEADLINE, attempt).await {
        Ok(result) => result,
        Err(_) => Err((Outcome::Hung, format!("no end within {REQUEST_DEADLINE:?}"))),
    }
}

/// What the clients share.
#[derive(Clone)]
struct Load {
    http: reqwest::Client,
    entries: Arc<Vec<String>>,
    /// Per entry point: bumped when a fault kills its process (its open streams die with
    /// it, which is no silent cut).
    epochs: Arc<Vec<AtomicU64>>,
    catalog: Arc<Catalog>,
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<Record>>>,
    t0: Instant,
}

impl Load {
    /// One request: sent, checked against `expected`, retried once when it failed (to
    /// learn whether a retry would have saved it), recorded. Whether it succeeded.
    async fn one(&self, entry: usize, path: &str, body: &Value, expected: &str) -> bool {
        let stream = body["stream"] == json!(true);
        let kind = match (path, body.get("conversation_id").is_some(), stream) {
            (_, true, false) => "conversation",
            (_, true, true) => "conversation_stream",
            ("/v1/completions", _, false) => "completion",
            ("/v1/completions", _, true) => "completion_stream",
            (_, _, false) => "chat",
            (_, _, true) => "chat_stream",
        };
        let url = format!("{}{path}", self.entries[entry]);
        let epoch = self.epochs[entry].load(Ordering::SeqCst);
        let start = self.t0.elapsed().as_secs_f64();
        let result = send(&self.http, &url, body).await;
        let end = self.t0.elapsed().as_secs_f64();
        let killed = self.epochs[entry].load(Ordering::SeqCst) != epoch;
        let (outcome, detail) = match result {
            Ok(text) if text == expected => (Outcome::Ok, String::new()),
            Ok(text) => (
                Outcome::Wrong,
                format!("{path} {body}: got {text:?}, want {expected:?}"),
            ),
            // Its entry process was killed under it: the stream died with the process.
            Err((Outcome::Cut | Outcome::Hung, detail)) if killed => {
                (Outcome::Failed, format!("entry killed: {detail}"))
            }
            Err((outcome, detail)) => (outcome, format!("{path}: {detail}")),
        };
        let retry_saved = if outcome == Outcome::Failed {
            Some(
                send(&self.http, &url, body)
                    .await
                    .is_ok_and(|t| t == expected),
            )
        } else {
            None
        };
        self.records.lock().unwrap().push(Record {
            kind,
            start,
            end,
            outcome,
            retry_saved,
            detail,
        });
        if outcome == Outcome::Failed {
            // A client backs off a little rather than spin on a refusing gateway.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        outcome == Outcome::Ok
    }

    async fn client(self, id: usize, seed: u64) {
        let mut rng = Rng(seed ^ (id as u64 + 1).wrapping_mul(0x5851_f42d_4c95_7f2d));
        let mut conversation = 0;
        while !self.stop.load(Ordering::SeqCst) {
            let entry = rng.below(self.entries.len());
            let stream = rng.below(2) == 0;
            match rng.below(5) {
                0 | 1 => {
                    let i = rng.below(CHATS.len());
                    let body = chat_body(json!([user(CHATS[i])]), stream);
                    self.one(entry, "/v1/chat/completions", &body, &self.catalog.chats[i])
                        .await;
                }
                2 | 3 => {
                    let i = rng.below(COMPLETIONS.len());
                    let body = completion_body(COMPLETIONS[i], stream);
                    self.one(
                        entry,
                        "/v1/completions",
                        &body,
                        &self.catalog.completions[i],
                    )
                    .await;
                }
                _ => {
                    conversation += 1;
                    let id = format!("chaos-{seed}-{id}-{conversation}");
                    let i = rng.below(CONVERSATIONS.len());
                    let (first, second) = CONVERSATIONS[i];
                    let (a1, a2) = &self.catalog.conversations[i];
                    let mut body = chat_body(json!([user(first)]), stream);
                    body["conversation_id"] = json!(id);
                    if self.one(entry, "/v1/chat/completions", &body, a1).await {
                        let turn2 = json!([user(first), {"role": "assistant", "content": a1}, user(second)]);
                        let mut body = chat_body(turn2, rng.below(2) == 0);
                        body["conversation_id"] = json!(id);
                        self.one(entry, "/v1/chat/completions", &body, a2).await;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Topologies.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    /// SIGSTOP a worker, SIGCONT it a few seconds later.
    Stop,
    /// SIGKILL a worker, start it again on the same port.
    KillSamePort,
    /// SIGKILL a worker, start it on new ports, rewrite the discovery file.
    KillNewPort,
    /// Cut every KV-transfer connection that carries data for a few seconds.
    KvCut,
    /// SIGKILL a gateway replica, start it again.
    GatewayRestart,
    /// SIGKILL a worker that publishes KV events, start it again (the publisher too).
    KvEventsRestart,
    /// Rewrite the discovery file (same workers, another order).
    DiscoveryRewrite,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Stop => "sigstop",
            Fault::KillSamePort => "kill_restart_same_port",
            Fault::KillNewPort => "kill_restart_new_port",
            Fault::KvCut => "kv_transfer_cut",
            Fault::GatewayRestart => "gateway_restart",
            Fault::KvEventsRestart => "kv_events_publisher_restart",
            Fault::DiscoveryRewrite => "discovery_rewrite",
        }
    }

    /// A process restarts: it must serve again within [`RECOVERY_BOUND`].
    fn is_restart(self) -> bool {
        matches!(
            self,
            Fault::KillSamePort
                | Fault::KillNewPort
                | Fault::GatewayRestart
                | Fault::KvEventsRestart
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    Vllm,
    Sglang,
    Orchestrator,
    Replicas,
}

impl Topology {
    fn name(self) -> &'static str {
        match self {
            Topology::Vllm => "vllm_2p1d",
            Topology::Sglang => "sglang_bootstrap",
            Topology::Orchestrator => "decode_orchestrator",
            Topology::Replicas => "gateway_replicas",
        }
    }

    fn faults(self) -> &'static [Fault] {
        match self {
            Topology::Vllm => &[
                Fault::Stop,
                Fault::KillSamePort,
                Fault::KillNewPort,
                Fault::KvCut,
                Fault::KvEventsRestart,
                Fault::DiscoveryRewrite,
            ],
            Topology::Sglang => &[
                Fault::Stop,
                Fault::KillSamePort,
                Fault::KillNewPort,
                Fault::DiscoveryRewrite,
            ],
            Topology::Orchestrator => &[Fault::Stop, Fault::KillSamePort],
            Topology::Replicas => &[
                Fault::GatewayRestart,
                Fault::Stop,
                Fault::KillSamePort,
                Fault::DiscoveryRewrite,
            ],
        }
    }
}

/// A worker process and how to start it again.
struct WorkerNode {
    name: String,
    role: &'static str,
    port: u16,
    kv_port: Option<u16>,
    bootstrap_port: Option<u16>,
    events_port: Option<u16>,
    /// Decode as orchestrator: its prefill workers.
    prefill: Vec<String>,
    /// Listed under this URL instead of its own (the KV relay in front of it).
    listed_as: Option<String>,
    proc: Option<Proc>,
}

impl WorkerNode {
    fn new(name: &str, role: &'static str) -> Self {
        Self {
            name: name.to_string(),
            role,
            port: free_port(),
            kv_port: None,
            bootstrap_port: None,
            events_port: None,
            prefill: Vec::new(),
            listed_as: None,
            proc: None,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn args(&self, model: &str) -> Vec<String> {
        let mut args: Vec<String> = [
            "worker",
            "--role",
            self.role,
            "--host",
            "127.0.0.1",
            "--model",
            model,
            "--served-model-name",
            "smollm2",
            "--threads",
            "1",
            "--num-kv-blocks",
            "256",
            "--bootstrap-timeout-secs",
            "10",
            "--prewarm-interval-secs",
            "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend([
            "--port".into(),
            self.port.to_string(),
            "--kv-abort-timeout".into(),
            KV_ABORT_TIMEOUT_SECS.to_string(),
        ]);
        if let Some(port) = self.kv_port {
            args.extend(["--kv-port".into(), port.to_string()]);
        }
        if let Some(port) = self.bootstrap_port {
            args.extend(["--bootstrap-port".into(), port.to_string()]);
        }
        if let Some(port) = self.events_port {
            let config = json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://127.0.0.1:{port}"),
            });
            args.extend(["--kv-events-config".into(), config.to_string()]);
        }
        for url in &self.prefill {
            args.extend(["--prefill".into(), url.clone()]);
        }
        args
    }
}

struct GatewayNode {
    port: u16,
    args: Vec<String>,
    proc: Option<Proc>,
}

impl GatewayNode {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// One topology's processes, and what a fault needs to act on them.
struct Cluster {
    topology: Topology,
    http: reqwest::Client,
    model: String,
    logs: PathBuf,
    workers: Vec<WorkerNode>,
    gateways: Vec<GatewayNode>,
    listing: Option<PathBuf>,
    proxy: Option<KvProxy>,
    _relay: Option<Relay>,
    entries: Arc<Vec<String>>,
    epochs: Arc<Vec<AtomicU64>>,
    /// Processes that exited without a fault killing them.
    unexpected_exits: Vec<String>,
}

impl Cluster {
    async fn start(topology: Topology, http: &reqwest::Client, model: &str, logs: &Path) -> Self {
        let mut workers = Vec::new();
        let mut proxy = None;
        let mut relay = None;
        match topology {
            Topology::Vllm => {
                // prefill-1 behind the relay, its KV pulled through the cutting proxy;
                // prefill-2 publishes KV events.
                let mut p1 = WorkerNode::new("prefill-1", "prefill");
                let kv_port = free_port();
                p1.kv_port = Some(kv_port);
                let kv = KvProxy::start(kv_port).await;
                let r = Relay::start(p1.url(), kv_port, kv.port).await;
                p1.listed_as = Some(format!("http://127.0.0.1:{}", r.port));
                let mut p2 = WorkerNode::new("prefill-2", "prefill");
                p2.events_port = Some(free_port());
                workers.extend([p1, p2, WorkerNode::new("decode-1", "decode")]);
                proxy = Some(kv);
                relay = Some(r);
            }
            Topology::Sglang => {
                let mut p = WorkerNode::new("prefill-1", "prefill");
                p.bootstrap_port = Some(free_port());
                workers.extend([p, WorkerNode::new("decode-1", "decode")]);
            }
            Topology::Orchestrator => {
                let p = WorkerNode::new("prefill-1", "prefill");
                let mut d = WorkerNode::new("decode-1", "decode");
                d.prefill = vec![p.url()];
                workers.extend([p, d]);
            }
            Topology::Replicas => {
                workers.extend([
                    WorkerNode::new("prefill-1", "prefill"),
                    WorkerNode::new("decode-1", "decode"),
                ]);
            }
        }
        let mut cluster = Self {
            topology,
            http: http.clone(),
            model: model.to_string(),
            logs: logs.to_path_buf(),
            workers,
            gateways: Vec::new(),
            listing: None,
            proxy,
            _relay: relay,
            entries: Arc::new(Vec::new()),
            epochs: Arc::new(Vec::new()),
            unexpected_exits: Vec::new(),
        };
        for i in 0..cluster.workers.len() {
            cluster.spawn_worker(i);
        }
        for i in 0..cluster.workers.len() {
            cluster.wait_worker(i).await;
        }
        let replicas = match topology {
            Topology::Orchestrator => 0,
            Topology::Replicas => 2,
            _ => 1,
        };
        if replicas > 0 {
            let listing = logs.join(format!("{}-workers.yaml", topology.name()));
            cluster.listing = Some(listing.clone());
            cluster.write_listing(None);
            let mut args: Vec<String> = [
                "gateway",
                "--host",
                "127.0.0.1",
                "--discover-interval",
                "0.5",
                "--probe-interval",
                "1",
                // Below the workers' --kv-abort-timeout, as the flag's help asks.
                "--conversation-ttl-secs",
                "3",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(["--discover-file".into(), listing.display().to_string()]);
            match topology {
                Topology::Sglang => args.extend(["--protocol".into(), "sglang".into()]),
                Topology::Vllm => args.extend(["--prefill-policy".into(), "cache_aware".into()]),
                _ => args.extend(["--decode-policy".into(), "session".into()]),
            }
            for _ in 0..replicas {
                let port = free_port();
                let mut args = args.clone();
                args.extend(["--port".into(), port.to_string()]);
                cluster.gateways.push(GatewayNode {
                    port,
                    args,
                    proc: None,
                });
            }
            for i in 0..replicas {
                cluster.spawn_gateway(i);
            }
            for i in 0..replicas {
                let url = cluster.gateways[i].url();
                let proc = cluster.gateways[i].proc.as_mut().unwrap();
                wait_healthy(http, &url, proc, Duration::from_secs(60)).await;
            }
            cluster.entries = Arc::new(cluster.gateways.iter().map(GatewayNode::url).collect());
        } else {
            let decode = cluster.workers.iter().find(|w| w.role == "decode").unwrap();
            cluster.entries = Arc::new(vec![decode.url()]);
        }
        cluster.epochs = Arc::new(cluster.entries.iter().map(|_| AtomicU64::new(0)).collect());
        // Serving end to end through every entry point before the load starts.
        for entry in cluster.entries.iter() {
            let started = Instant::now();
            loop {
                let body = completion_body(COMPLETIONS[0], false);
                let url = format!("{entry}/v1/completions");
                if send(http, &url, &body).await.is_ok() {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "{}: {entry} never served",
                    topology.name()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        cluster
    }

    fn log(&self, name: &str) -> PathBuf {
        self.logs
            .join(format!("{}-{name}.log", self.topology.name()))
    }

    fn spawn_worker(&mut self, i: usize) {
        let w = &self.workers[i];
        let proc = Proc::spawn(&w.name, &w.args(&self.model), &self.log(&w.name));
        self.workers[i].proc = Some(proc);
    }

    /// Waits for worker `i`'s health; the instant it answered.
    async fn wait_worker(&mut self, i: usize) -> Instant {
        let url = self.workers[i].url();
        let proc = self.workers[i].proc.as_mut().unwrap();
        wait_healthy(&self.http, &url, proc, Duration::from_secs(120)).await
    }

    fn spawn_gateway(&mut self, i: usize) {
        let name = format!("gateway-{}", i + 1);
        let proc = Proc::spawn(&name, &self.gateways[i].args, &self.log(&name));
        self.gateways[i].proc = Some(proc);
    }

    /// Writes the discovery file (atomically: a temporary file renamed over it), the
    /// workers in `order` (default: as started).
    fn write_listing(&self, order: Option<&[usize]>) {
        let Some(listing) = &self.listing else { return };
        let all: Vec<usize> = (0..self.workers.len()).collect();
        let mut yaml = String::from("workers:\n");
        for &i in order.unwrap_or(&all) {
            let w = &self.workers[i];
            let url = w.listed_as.clone().unwrap_or_else(|| w.url());
            yaml.push_str(&format!("  - url: {url}\n    role: {}\n", w.role));
            if let Some(port) = w.bootstrap_port {
                yaml.push_str(&format!("    bootstrap_port: {port}\n"));
            }
            if let Some(port) = w.events_port {
                yaml.push_str(&format!("    kv_events_endpoint: tcp://127.0.0.1:{port}\n"));
            }
        }
        let tmp = listing.with_extension("tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, listing).unwrap();
    }

    /// Notes every process that exited though no fault killed it.
    /// Each is started again, so that the run goes on.
    fn check_alive(&mut self) {
        let mut exits = Vec::new();
        for i in 0..self.workers.len() {
            let w = &mut self.workers[i];
            if let Some(status) = w.proc.as_mut().and_then(Proc::exited) {
                exits.push(format!("{} ({status})", w.name));
                self.spawn_worker(i);
            }
        }
        for i in 0..self.gateways.len() {
            if let Some(status) = self.gateways[i].proc.as_mut().and_then(Proc::exited) {
                exits.push(format!("gateway-{} ({status})", i + 1));
                self.spawn_gateway(i);
            }
        }
        for exit in exits {
            eprintln!("chaos: {}: {exit} exited on its own", self.topology.name());
            self.unexpected_exits.push(exit);
        }
    }

    /// Injects `fault` on a target `rng` picks; what it hit and the instant the fault
    /// ended (the process back and healthy, the signal sent, the file written), and
    /// for a gateway restart which entry point to probe.
    async fn inject(
        &mut self,
        fault: Fault,
        rng: &mut Rng,
        long: bool,
    ) -> (String, Instant, Option<usize>) {
        let hold = |rng: &mut Rng| {
            if long {
                rng.secs(2.0, 6.0)
            } else {
                rng.secs(1.5, 3.0)
            }
        };
        match fault {
            Fault::Stop => {
                let i = rng.below(self.workers.len());
                let proc = self.workers[i].proc.as_ref().unwrap();
                proc.signal(libc::SIGSTOP);
                tokio::time::sleep(hold(rng)).await;
                proc.signal(libc::SIGCONT);
                (self.workers[i].name.clone(), Instant::now(), None)
            }
            Fault::KillSamePort | Fault::KillNewPort | Fault::KvEventsRestart => {
                let candidates: Vec<usize> = (0..self.workers.len())
                    .filter(|&i| {
                        let w = &self.workers[i];
                        match fault {
                            Fault::KvEventsRestart => w.events_port.is_some(),
                            // The relayed worker keeps its port; so does an orchestrator's
                            // prefill worker (named on the decode worker's command line).
                            Fault::KillNewPort => w.listed_as.is_none(),
                            _ => true,
                        }
                    })
                    .collect();
                let i = candidates[rng.below(candidates.len())];
                let entry = self
                    .entries
                    .iter()
                    .position(|e| *e == self.workers[i].url());
                if let Some(entry) = entry {
                    self.epochs[entry].fetch_add(1, Ordering::SeqCst);
                }
                self.workers[i].proc = None; // SIGKILL (Drop)
                tokio::time::sleep(rng.secs(0.3, 1.5)).await;
                if fault == Fault::KillNewPort {
                    let w = &mut self.workers[i];
                    w.port = free_port();
                    if w.bootstrap_port.is_some() {
                        w.bootstrap_port = Some(free_port());
                    }
                    if w.events_port.is_some() {
                        w.events_port = Some(free_port());
                    }
                }
                self.spawn_worker(i);
                let mut healthy = self.wait_worker(i).await;
                if fault == Fault::KillNewPort {
                    self.write_listing(None);
                    healthy = Instant::now();
                }
                let what = format!("{} (now {})", self.workers[i].name, self.workers[i].url());
                (what, healthy, None)
            }
            Fault::KvCut => {
                let proxy = self.proxy.as_ref().unwrap();
                let before = proxy.cuts.load(Ordering::SeqCst);
                proxy.armed.store(true, Ordering::SeqCst);
                // Until a transfer was cut (or long enough that none came).
                let started = Instant::now();
                let hold = hold(rng);
                while started.elapsed() < hold
                    || (proxy.cuts.load(Ordering::SeqCst) == before
                        && started.elapsed() < Duration::from_secs(8))
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                proxy.armed.store(false, Ordering::SeqCst);
                let cut = proxy.cuts.load(Ordering::SeqCst) - before;
                (
                    format!("prefill-1 KV ({cut} connections cut)"),
                    Instant::now(),
                    None,
                )
            }
            Fault::GatewayRestart => {
                let i = rng.below(self.gateways.len());
                self.epochs[i].fetch_add(1, Ordering::SeqCst);
                self.gateways[i].proc = None; // SIGKILL (Drop)
                tokio::time::sleep(rng.secs(0.3, 1.5)).await;
                self.spawn_gateway(i);
                let url = self.gateways[i].url();
                let proc = self.gateways[i].proc.as_mut().unwrap();
                let healthy = wait_healthy(&self.http, &url, proc, Duration::from_secs(60)).await;
                (format!("gateway-{}", i + 1), healthy, Some(i))
            }
            Fault::DiscoveryRewrite => {
                let mut order: Vec<usize> = (0..self.workers.len()).collect();
                rng.shuffle(&mut order);
                self.write_listing(Some(&order));
                (format!("order {order:?}"), Instant::now(), None)
            }
        }
    }

    /// Every worker back to 0 blocks used, pinned or published and 0 running, and every
    /// gateway at 0 in flight, within the KV abort timeout (plus a scrape's slack).
    /// What is still held when time is up.
    async fn leaks(&self) -> Vec<String> {
        let limit = Duration::from_secs(KV_ABORT_TIMEOUT_SECS + 3);
        let started = Instant::now();
        let mut targets: Vec<(String, &[&str])> = Vec::new();
        const WORKER: &[&str] = &[
            "pdserve_kv_blocks_used",
            "pdserve_kv_blocks_pinned",
            "pdserve_kv_transfer_pinned_blocks",
            "pdserve_num_requests_running",
        ];
        const GATEWAY: &[&str] = &["pdserve_gateway_worker_in_flight"];
        for w in &self.workers {
            targets.push((w.url(), WORKER));
        }
        for g in &self.gateways {
            targets.push((g.url(), GATEWAY));
        }
        let mut held = Vec::new();
        for (base, names) in targets {
            loop {
                let text = match self.http.get(format!("{base}/metrics")).send().await {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(_) => String::new(),
                };
                let nonzero: Vec<String> = names
                    .iter()
                    .filter_map(|name| {
                        let v = metric_sum(&text, name)?;
                        (v != 0.0).then(|| format!("{name} {v}"))
                    })
                    .collect();
                let missing = names.iter().any(|n| metric_sum(&text, n).is_none())
                    && !names.contains(&"pdserve_gateway_worker_in_flight");
                if nonzero.is_empty() && !missing {
                    break;
                }
                if started.elapsed() > limit {
                    held.push(format!(
                        "{base}: {nonzero:?}{}",
                        if missing { " (metrics missing)" } else { "" }
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        held
    }
}

impl Cluster {
    /// What the gateways refused for want of a worker, by role and reason (a restarted
    /// replica counts from its restart).
    async fn refusals(&self) -> BTreeMap<String, f64> {
        let name = "pdserve_gateway_refused_total{";
        let mut refused = BTreeMap::new();
        for g in &self.gateways {
            let Ok(response) = self.http.get(format!("{}/metrics", g.url())).send().await else {
                continue;
            };
            let text = response.text().await.unwrap_or_default();
            for line in text.lines().filter(|l| l.starts_with(name)) {
                if let Some((labels, value)) = line[name.len()..].rsplit_once("} ") {
                    *refused.entry(labels.to_string()).or_default() +=
                        value.parse::<f64>().unwrap_or(0.0);
                }
            }
        }
        refused
    }
}

/// The sum of the samples named `name` (any labels); `None` when there is none.
fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// One injected fault, as the summary reports it.
#[derive(Debug, Clone)]
struct FaultRecord {
    topology: &'static str,
    kind: Fault,
    target: String,
    injected: f64,
    ended: f64,
    /// Seconds from the fault's end to the first success through the gateway; `None`
    /// when nothing succeeded within the probing window.
    recovered_after: Option<f64>,
}

/// Sends a request every 250 ms from `from` on until one succeeds (at most `limit`);
/// seconds from `from` to the end of the first success. Wrong answers are counted.
async fn recovery(
    http: &reqwest::Client,
    entry: &str,
    catalog: &Catalog,
    from: Instant,
    limit: Duration,
    wrong: &mut Vec<String>,
) -> Option<f64> {
    let mut probes = JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let url = format!("{entry}/v1/completions");
    let body = completion_body(COMPLETIONS[1], false);
    let expected = catalog.completions[1].clone();
    loop {
        tokio::select! {
            _ = tick.tick(), if from.elapsed() < limit => {
                let (http, url, body) = (http.clone(), url.clone(), body.clone());
                probes.spawn(async move { send(&http, &url, &body).await });
            }
            Some(done) = probes.join_next() => {
                match done.unwrap() {
                    Ok(text) if text == expected => return Some(from.elapsed().as_secs_f64()),
                    Ok(text) => wrong.push(format!("probe got {text:?}, want {expected:?}")),
                    Err(_) => {}
                }
            }
            else => return None,
        }
        if from.elapsed() >= limit && probes.is_empty() {
            return None;
        }
    }
}

// ---------------------------------------------------------------------------------------
// The run.

struct TopologyRun {
    topology: Topology,
    records: Vec<Record>,
    faults: Vec<FaultRecord>,
    wrong_probes: Vec<String>,
    leaks: Vec<String>,
    unexpected_exits: Vec<String>,
    kv_cuts: u64,
    /// The gateways' `pdserve_gateway_refused_total` samples (summed over replicas).
    refused: BTreeMap<String, f64>,
    seconds: f64,
}

/// What every topology's run shares.
struct Env {
    seed: u64,
    long: bool,
    http: reqwest::Client,
    model: String,
    logs: PathBuf,
    catalog: Arc<Catalog>,
}

async fn run_topology(env: &Env, topology: Topology, secs: f64) -> TopologyRun {
    let Env {
        seed,
        long,
        http,
        model,
        logs,
        catalog,
    } = env;
    let (seed, long) = (*seed, *long);
    let started = Instant::now();
    let mut cluster = Cluster::start(topology, http, model, logs).await;
    eprintln!(
        "chaos: {} up in {:.1} s; load for {secs:.0} s",
        topology.name(),
        started.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    let load = Load {
        http: http.clone(),
        entries: cluster.entries.clone(),
        epochs: cluster.epochs.clone(),
        catalog: catalog.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        records: Arc::new(Mutex::new(Vec::new())),
        t0,
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(load.clone().client(id, seed)))
        .collect();

    let mut rng = Rng(seed ^ topology as u64);
    let mut faults = Vec::new();
    let mut wrong_probes = Vec::new();
    let until = t0 + Duration::from_secs_f64(secs);
    let mut bag: Vec<Fault> = Vec::new();
    // Some undisturbed load first.
    tokio::time::sleep(rng.secs(1.0, 2.0)).await;
    while Instant::now() < until {
        if bag.is_empty() {
            bag = topology.faults().to_vec();
            rng.shuffle(&mut bag);
        }
        let fault = bag.pop().unwrap();
        let injected = t0.elapsed().as_secs_f64();
        let (target, ended, entry) = cluster.inject(fault, &mut rng, long).await;
        let entry = entry.unwrap_or(0);
        let recovered_after = recovery(
            http,
            &cluster.entries[entry],
            catalog,
            ended,
            Duration::from_secs(40),
            &mut wrong_probes,
        )
        .await;
        let record = FaultRecord {
            topology: topology.name(),
            kind: fault,
            target,
            injected,
            ended: ended.duration_since(t0).as_secs_f64(),
            recovered_after,
        };
        eprintln!(
            "chaos: {:>6.1} s {} {} {}: recovered after {}",
            injected,
            topology.name(),
            fault.name(),
            record.target,
            recovered_after.map_or("never".to_string(), |s| format!("{s:.2} s"))
        );
        faults.push(record);
        cluster.check_alive();
        let gap = if long {
            rng.secs(1.0, 4.0)
        } else {
            rng.secs(0.5, 1.5)
        };
        tokio::time::sleep(gap).await;
    }
    load.stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }
    cluster.check_alive();
    let leaks = cluster.leaks().await;
    cluster.check_alive();
    let refused = cluster.refusals().await;
    let records = load.records.lock().unwrap().clone();
    TopologyRun {
        topology,
        records,
        faults,
        wrong_probes,
        leaks,
        unexpected_exits: cluster.unexpected_exits.clone(),
        kv_cuts: cluster
            .proxy
            .as_ref()
            .map_or(0, |p| p.cuts.load(Ordering::SeqCst)),
        refused,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The failures a fault explains: those that ended between its injection and a few
/// seconds after it recovered, before the next fault. Unexplained ones are reported.
fn attribute(run: &TopologyRun, record: &Record) -> Option<Fault> {
    let grace = 3.0;
    run.faults
        .iter()
        .rev()
        .find(|f| f.injected <= record.end)
        .filter(|f| record.end <= f.ended + f.recovered_after.unwrap_or(40.0) + grace)
        .map(|f| f.kind)
}

/// One kind of fault over the whole run.
#[derive(Default)]
struct KindStats {
    injected: usize,
    failed: usize,
    saved: usize,
    recoveries: Vec<f64>,
    /// A few distinct failures it caused (status and message).
    examples: Vec<String>,
}

fn summarize(seed: u64, long: bool, runs: &[TopologyRun]) -> Value {
    let mut by_kind: BTreeMap<Fault, KindStats> = BTreeMap::new();
    let mut served_by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    let mut unattributed = Vec::new();
    let (mut served, mut failed, mut hung, mut cut, mut wrong, mut leaked) = (0, 0, 0, 0, 0, 0);
    let mut violations = Vec::new();
    let mut topologies = serde_json::Map::new();
    for run in runs {
        for f in &run.faults {
            let entry = by_kind.entry(f.kind).or_default();
            entry.injected += 1;
            if let Some(s) = f.recovered_after {
                entry.recoveries.push(s);
            }
            if f.kind.is_restart()
                && !f
                    .recovered_after
                    .is_some_and(|s| s <= RECOVERY_BOUND.as_secs_f64())
            {
                violations.push(format!(
                    "{} {} {} at {:.1} s: first success {} after it was back",
                    f.topology,
                    f.kind.name(),
                    f.target,
                    f.ended,
                    f.recovered_after
                        .map_or("never".into(), |s| format!("{s:.2} s"))
                ));
            }
        }
        let mut counts = [0usize; 5];
        for r in &run.records {
            match r.outcome {
                Outcome::Ok => {
                    served += 1;
                    *served_by_kind.entry(r.kind).or_default() += 1;
                }
                Outcome::Failed => {
                    failed += 1;
                    match attribute(run, r) {
                        Some(kind) => {
                            let entry = by_kind.entry(kind).or_default();
                            entry.failed += 1;
                            entry.saved += usize::from(r.retry_saved == Some(true));
                            // Ports and ids differ; the first 120 characters tell the kind.
                            let example: String = r.detail.chars().take(120).collect();
                            if entry.examples.len() < 4 && !entry.examples.contains(&example) {
                                entry.examples.push(example);
                            }
                        }
                        None => unattributed.push(format!(
                            "{} {:.1}-{:.1} s: {}",
                            run.topology.name(),
                            r.start,
                            r.end,
                            r.detail
                        )),
                    }
                }
                Outcome::Cut => cut += 1,
                Outcome::Hung => hung += 1,
                Outcome::Wrong => wrong += 1,
            }
            counts[r.outcome as usize] += 1;
        }
        wrong += run.wrong_probes.len();
        leaked += run.leaks.len();
        topologies.insert(
            run.topology.name().into(),
            json!({
                "seconds": run.seconds,
                "served": counts[Outcome::Ok as usize],
                "failed": counts[Outcome::Failed as usize],
                "cut": counts[Outcome::Cut as usize],
                "hung": counts[Outcome::Hung as usize],
                "wrong": counts[Outcome::Wrong as usize] + run.wrong_probes.len(),
                "faults": run.faults.len(),
                "kv_connections_cut": run.kv_cuts,
                "gateway_refused": run.refused,
                "leaks": run.leaks,
                "unexpected_exits": run.unexpected_exits,
            }),
        );
    }
    let mut faults = serde_json::Map::new();
    for (kind, stats) in by_kind {
        let KindStats {
            injected,
            failed,
            saved,
            mut recoveries,
            examples,
        } = stats;
        recoveries.sort_by(f64::total_cmp);
        faults.insert(
            kind.name().into(),
            json!({
                "injected": injected,
                "requests_failed": failed,
                "retry_would_have_saved": saved,
                "retry_share": if failed == 0 { 0.0 } else { saved as f64 / failed as f64 },
                "recover_p50_s": percentile(&recoveries, 50.0),
                "recover_p99_s": percentile(&recoveries, 99.0),
                "never_recovered": injected - recoveries.len(),
                "failure_examples": examples,
            }),
        );
    }
    let exits: Vec<&String> = runs.iter().flat_map(|r| &r.unexpected_exits).collect();
    json!({
        "seed": seed,
        "form": if long { "long" } else { "short" },
        "seconds": runs.iter().map(|r| r.seconds).sum::<f64>(),
        "requests": {
            "served": served,
            "served_by_kind": served_by_kind,
            "failed": failed,
            "unattributed_failures": unattributed.len(),
        },
        "faults": faults,
        "hung": hung,
        "cut": cut,
        "wrong": wrong,
        "leaked": leaked,
        "unexpected_exits": exits,
        "recovery_violations": violations,
        "unattributed_failures": unattributed,
        "topologies": topologies,
    })
}

fn print_summary(summary: &Value) {
    println!(
        "chaos summary (seed {}, {} form, {:.0} s of load)",
        summary["seed"],
        summary["form"].as_str().unwrap(),
        summary["seconds"].as_f64().unwrap()
    );
    println!(
        "  requests served {}, failed {} ({} not explained by a fault)",
        summary["requests"]["served"],
        summary["requests"]["failed"],
        summary["requests"]["unattributed_failures"]
    );
    println!(
        "  served by kind: {}",
        summary["requests"]["served_by_kind"]
    );
    // A Markdown table, as the README's Reliability section shows it.
    println!("| fault | injected | requests failed | a retry would have saved | recovery p50 | recovery p99 |");
    println!("|---|--:|--:|--:|--:|--:|");
    for (kind, f) in summary["faults"].as_object().unwrap() {
        let secs = |v: &Value| v.as_f64().map_or("-".to_string(), |s| format!("{s:.2} s"));
        println!(
            "| {kind} | {} | {} | {:.0} % | {} | {} |",
            f["injected"].as_u64().unwrap(),
            f["requests_failed"].as_u64().unwrap(),
            f["retry_share"].as_f64().unwrap() * 100.0,
            secs(&f["recover_p50_s"]),
            secs(&f["recover_p99_s"]),
        );
    }
    println!(
        "  hung {}, cut {}, wrong {}, leaked {}, unexpected exits {}, recovery violations {}",
        summary["hung"],
        summary["cut"],
        summary["wrong"],
        summary["leaked"],
        summary["unexpected_exits"].as_array().unwrap().len(),
        summary["recovery_violations"].as_array().unwrap().len(),
    );
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok().filter(|v| !v.is_empty())?;
    Some(
        value
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value}: {e}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_under_load_nothing_hangs_leaks_or_lies() {
    let seed = env_u64("PDSERVE_CHAOS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            % 1_000_000_007
    });
    let long_secs = env_u64("PDSERVE_CHAOS_SECS");
    let long = long_secs.is_some();
    // The long form splits its time 2:1:1:1 (the vLLM topology is the C2-chaos bar);
    // the short form gives each topology a few faults' worth.
    let plan: Vec<(Topology, f64)> = match long_secs {
        Some(total) => {
            let fifth = total as f64 / 5.0;
            vec![
                (Topology::Vllm, 2.0 * fifth),
                (Topology::Sglang, fifth),
                (Topology::Orchestrator, fifth),
                (Topology::Replicas, fifth),
            ]
        }
        None => vec![
            (Topology::Vllm, 40.0),
            (Topology::Sglang, 20.0),
            (Topology::Orchestrator, 14.0),
            (Topology::Replicas, 20.0),
        ],
    };
    println!("chaos: seed {seed} (PDSERVE_CHAOS_SEED={seed} replays it)");
    eprintln!("chaos: seed {seed} (PDSERVE_CHAOS_SEED={seed} replays it)");
    let bound = Duration::from_secs_f64(plan.iter().map(|p| p.1).sum::<f64>() + 400.0);
    let logs = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("chaos-{seed}"));
    std::fs::create_dir_all(&logs).unwrap();
    pin_binary(&logs);
    let summary = tokio::time::timeout(bound, async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let model = model.display().to_string();
        // References first, from an aggregated worker, which then makes room.
        let catalog = {
            let mut agg = WorkerNode::new("aggregated", "both");
            let proc = Proc::spawn(&agg.name, &agg.args(&model), &logs.join("aggregated.log"));
            agg.proc = Some(proc);
            let url = agg.url();
            wait_healthy(
                &http,
                &url,
                agg.proc.as_mut().unwrap(),
                Duration::from_secs(120),
            )
            .await;
            Arc::new(Catalog::compute(&http, &url).await)
        };
        let env = Env {
            seed,
            long,
            http,
            model,
            logs: logs.clone(),
            catalog,
        };
        let mut runs = Vec::new();
        for (topology, secs) in plan {
            runs.push(run_topology(&env, topology, secs).await);
        }
        summarize(seed, long, &runs)
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "chaos run (seed {seed}) exceeded {bound:?}; logs in {}",
            logs.display()
        )
    });

    // Every process is gone (the clusters dropped): the private binary can go too.
    let _ = std::fs::remove_file(BINARY.get().unwrap());
    print_summary(&summary);
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chaos-summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    println!(
        "chaos: summary in {}, logs in {}",
        path.display(),
        logs.display()
    );

    let context = format!("seed {seed}, logs in {}: {summary:#}", logs.display());
    assert_eq!(
        summary["hung"], 0,
        "requests past their deadline; {context}"
    );
    assert_eq!(summary["cut"], 0, "streams cut silently; {context}");
    assert_eq!(
        summary["wrong"], 0,
        "answers differ from the aggregated ones; {context}"
    );
    assert_eq!(
        summary["leaked"], 0,
        "blocks or requests still held after the load; {context}"
    );
    assert_eq!(
        summary["unexpected_exits"],
        json!([]),
        "a process died on its own; {context}"
    );
    assert_eq!(
        summary["recovery_violations"],
        json!([]),
        "slow recovery after a restart; {context}"
    );
    assert_eq!(
        summary["unattributed_failures"],
        json!([]),
        "failures no fault explains; {context}"
    );
    assert!(
        summary["requests"]["served"].as_u64() > Some(0),
        "nothing was served; {context}"
    );
    let cuts = summary["topologies"]["vllm_2p1d"]["kv_connections_cut"]
        .as_u64()
        .unwrap();
    assert!(cuts > 0, "the KV proxy never cut a transfer; {context}");
}
