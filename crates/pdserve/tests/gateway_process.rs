//! The `pdserve gateway` process with real workers: on SIGTERM it stops accepting
//! connections, lets an open stream run to its end, then exits 0; when a `pdserve worker`
//! process is killed under load it is evicted with no failed client request, and it is
//! re-admitted when it comes back on the same port; when the only worker of a role
//! restarts, the first request after it is healthy again is served (panic routing), not
//! refused until the next probe.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::{Worker, WorkerArgs};
use tokio::net::TcpListener;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

/// Kills the child if the test fails before it exits on its own.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free port from outside the ephemeral range, where no `bind(0)` or outgoing
/// connection of a sibling test can take it before the process it is for binds it.
fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

/// The next body chunk of a streaming response, as text.
async fn next_chunk(resp: &mut reqwest::Response) -> Option<String> {
    resp.chunk()
        .await
        .unwrap()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_open_stream_finish_then_exits_0() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let args = Cli::try_parse_from([
            "worker",
            "--role",
            "both",
            "--model",
            &model.display().to_string(),
            "--threads",
            "1",
            "--num-kv-blocks",
            "64",
        ])
        .unwrap()
        .args;
        let worker = Worker::start(listener, args).await.unwrap();
        let worker_url = format!("http://{}", worker.local_addr());

        let port = free_port();
        let gateway = format!("http://127.0.0.1:{port}");
        let mut child = Reaper(
            Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args([
                    "gateway",
                    "--port",
                    &port.to_string(),
                    "--worker",
                    &worker_url,
                ])
                .args(["--shutdown-timeout", "60"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let http = reqwest::Client::new();
        let start = Instant::now();
        loop {
            let ok = http
                .get(format!("{gateway}/health"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if ok {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "gateway not ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let mut resp = http
            .post(format!("{gateway}/v1/completions"))
            .json(&serde_json::json!({
                "prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": true,
                "temperature": 0, "stream": true
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = next_chunk(&mut resp).await.unwrap();

        // SAFETY: signalling our own child process.
        unsafe {
            libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM);
        }
        // New connections are refused while the open stream drains.
        let refused_by = Instant::now() + Duration::from_secs(5);
        loop {
            let fresh = reqwest::Client::new();
            if fresh
                .get(format!("{gateway}/liveness"))
                .send()
                .await
                .is_err()
            {
                break;
            }
            assert!(Instant::now() < refused_by, "still accepting after SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "the gateway exited with a stream still open"
        );
        while let Some(chunk) = next_chunk(&mut resp).await {
            body.push_str(&chunk);
        }
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        assert!(!body.contains("\"error\""), "{body}");
        let tokens = body.matches("\"text\"").count();
        assert!(
            tokens >= 96,
            "the whole generation arrived ({tokens} chunks)"
        );

        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.0.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "gateway did not exit after draining"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(status.success(), "{status}");
        drop(worker);
    })
    .await
    .expect("test exceeded its time limit");
}

/// Starts `pdserve worker --role both` on `port`, one thread, and waits for its /health.
async fn worker_process(port: u16, model: &std::path::Path) -> Reaper {
    role_process("both", port, model).await
}

/// Starts `pdserve worker --role ROLE` on `port`, one thread, and waits for its /health.
async fn role_process(role: &str, port: u16, model: &std::path::Path) -> Reaper {
    let child = Reaper(
        Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["worker", "--role", role, "--port", &port.to_string()])
            .args(["--threads", "1", "--num-kv-blocks", "64"])
            .arg("--model")
            .arg(model)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        &format!("http://127.0.0.1:{port}/health"),
        Duration::from_secs(120),
    )
    .await;
    child
}

async fn wait_for(url: &str, limit: Duration) {
    let start = Instant::now();
    loop {
        let ok = reqwest::get(url).await.is_ok_and(|r| r.status() == 200);
        if ok {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{url} not healthy within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The gateway's view of the worker at `url`: its `health`, if registered.
async fn health_in_roster(gateway: &str, url: &str) -> Option<String> {
    let roster: serde_json::Value = reqwest::get(format!("{gateway}/instances"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    roster["workers"]
        .as_array()?
        .iter()
        .find(|w| w["url"] == url)
        .map(|w| w["health"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_process_is_evicted_without_failed_requests_and_readmitted() {
    tokio::time::timeout(Duration::from_secs(400), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let (port_a, port_b) = (free_port(), free_port());
        let (url_a, url_b) = (
            format!("http://127.0.0.1:{port_a}"),
            format!("http://127.0.0.1:{port_b}"),
        );
        let _a = worker_process(port_a, &model).await;
        let mut b = Some(worker_process(port_b, &model).await);
        let port = free_port();
        let gateway = format!("http://127.0.0.1:{port}");
        let (interval, threshold) = (Duration::from_millis(500), 3);
        let _gw = Reaper(
            Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args(["gateway", "--port", &port.to_string()])
                .args(["--worker", &url_a, "--worker", &url_b])
                .args(["--probe-interval", "0.5", "--probe-timeout", "1", "--fail-threshold", "3"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_for(&format!("{gateway}/health"), Duration::from_secs(30)).await;

        let http = reqwest::Client::new();
        let request = || async {
            let resp = http
                .post(format!("{gateway}/v1/completions"))
                .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status();
            let body = resp.text().await.map_err(|e| e.to_string())?;
            if status == 200 && body.contains("\"choices\"") {
                Ok(())
            } else {
                Err(format!("{status}: {body}"))
            }
        };
        let mut sent = 0;
        let mut failed = Vec::new();
        for _ in 0..4 {
            sent += 1;
            if let Err(e) = request().await {
                failed.push(e);
            }
        }

        // SIGKILL: the worker dies with no goodbye, as a crashed process does.
        drop(b.take());
        let killed = Instant::now();
        let mut evicted_after = None;
        while killed.elapsed() < Duration::from_secs(10) {
            sent += 1;
            if let Err(e) = request().await {
                failed.push(e);
            }
            if evicted_after.is_none()
                && health_in_roster(&gateway, &url_b).await.as_deref() == Some("evicted")
            {
                evicted_after = Some(killed.elapsed());
                break;
            }
        }
        let evicted_after = evicted_after.expect("the killed worker was not evicted");
        assert!(evicted_after <= interval * threshold + Duration::from_secs(2), "{evicted_after:?}");
        assert_eq!(reqwest::get(format!("{gateway}/health")).await.unwrap().status(), 200);

        // Restart on the same port: the next healthy probe re-admits it.
        let _b = worker_process(port_b, &model).await;
        let back = Instant::now();
        while health_in_roster(&gateway, &url_b).await.as_deref() != Some("live") {
            assert!(back.elapsed() < interval * 4, "not re-admitted within 4 probe intervals");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let readmitted_after = back.elapsed();
        for _ in 0..4 {
            sent += 1;
            if let Err(e) = request().await {
                failed.push(e);
            }
        }
        eprintln!(
            "real-process kill: evicted {evicted_after:?} after SIGKILL, re-admitted {readmitted_after:?} \
             after the restarted worker was healthy; {sent} requests, {} failed",
            failed.len()
        );
        assert!(failed.is_empty(), "{failed:?}");
    })
    .await
    .expect("test exceeded its time limit");
}

/// Envoy's panic threshold: the only decode (then the only prefill) worker is killed and
/// restarted on the same port. The probe is far away (60 s), so only a request can notice:
/// while the worker is down a request gets 503 (the evicted worker was tried and refused
/// the connection) and `/health` says 503; the first request after the worker answers
/// `/health` again gets 200 and re-admits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_after_the_only_worker_of_a_role_restarts_is_served() {
    tokio::time::timeout(Duration::from_secs(400), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let (port_p, port_d) = (free_port(), free_port());
        let (url_p, url_d) = (
            format!("http://127.0.0.1:{port_p}"),
            format!("http://127.0.0.1:{port_d}"),
        );
        let mut prefill = Some(role_process("prefill", port_p, &model).await);
        let mut decode = Some(role_process("decode", port_d, &model).await);
        let port = free_port();
        let gateway = format!("http://127.0.0.1:{port}");
        let _gw = Reaper(
            Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args(["gateway", "--port", &port.to_string()])
                .args(["--prefill", &url_p, "--decode", &url_d])
                .args(["--probe-interval", "60"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_for(&format!("{gateway}/health"), Duration::from_secs(30)).await;
        let http = reqwest::Client::new();
        let request = || async {
            let resp = http
                .post(format!("{gateway}/v1/completions"))
                .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.text().await.unwrap())
        };
        let (status, body) = request().await;
        assert_eq!(status, 200, "{body}");

        for (role, url, port) in [("decode", &url_d, port_d), ("prefill", &url_p, port_p)] {
            // SIGKILL, as a crash: the next request finds nothing listening.
            match role {
                "decode" => drop(decode.take()),
                _ => drop(prefill.take()),
            }
            // The first request finds it gone (502: it was live when chosen) and evicts it
            // (a pooled connection's reset counts one failure; a refused connect evicts).
            let mut failed = 0;
            while health_in_roster(&gateway, url).await.as_deref() != Some("evicted") {
                let (status, body) = request().await;
                assert!(
                    status == 502 || status == 503,
                    "{role} down: {status} {body}"
                );
                failed += 1;
                assert!(
                    failed <= 3,
                    "{role} not evicted after {failed} failed requests"
                );
            }
            let health = reqwest::get(format!("{gateway}/health")).await.unwrap();
            assert_eq!(health.status(), 503, "no healthy {role} worker");
            // The next ones still try it (panic) rather than refuse, and say why they fail.
            let (status, body) = request().await;
            assert_eq!(status, 503, "{body}");
            assert!(
                body.contains("is evicted and refused the connection"),
                "{body}"
            );

            let restarted = role_process(role, port, &model).await;
            match role {
                "decode" => decode = Some(restarted),
                _ => prefill = Some(restarted),
            }
            let (status, body) = request().await;
            assert_eq!(
                status, 200,
                "the first request after the {role} worker restarted: {body}"
            );
            assert_eq!(
                health_in_roster(&gateway, url).await.as_deref(),
                Some("live"),
                "a served request re-admits the {role} worker before any probe"
            );
            let health = reqwest::get(format!("{gateway}/health")).await.unwrap();
            assert_eq!(health.status(), 200);
        }
        let metrics = reqwest::get(format!("{gateway}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for role in ["decode", "prefill"] {
            let line = format!("pdserve_gateway_panic_routed_total{{role=\"{role}\"}}");
            assert!(
                metrics
                    .lines()
                    .any(|l| l.starts_with(&line) && !l.ends_with(" 0")),
                "{line} missing or 0 in:\n{metrics}"
            );
        }
    })
    .await
    .expect("test exceeded its time limit");
}

/// `pdserve gateway --worker <its own URL>` would send every request back to itself:
/// the process refuses to run, saying why, instead of serving a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_given_its_own_url_as_a_worker_refuses_to_start() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["gateway", "--port", &port.to_string(), "--worker", &url])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Reaper(child);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the gateway kept running with itself as a worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.contains(&url) && stderr.contains("itself"),
        "{stderr}"
    );
}
