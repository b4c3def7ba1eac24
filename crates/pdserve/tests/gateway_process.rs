//! The `pdserve gateway` process on SIGTERM: it stops accepting connections, lets an
//! open stream from a real worker run to its end, then exits 0.

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
