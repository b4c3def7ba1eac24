//! `pdserve up` end to end: the real binary starts a prefill worker, a decode worker and
//! a gateway, answers a chat request through them, and stops every process on Ctrl-C
//! (SIGINT).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn up_serves_through_the_gateway_and_stops_cleanly() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let port = free_port();
    let mut up = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["up", "--port", &port.to_string(), "--cores", "2"])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut worker_urls = Vec::new();
    loop {
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(l) => l,
            Err(e) => {
                let _ = up.kill();
                panic!("pdserve up did not come up: {e}");
            }
        };
        if let Some(at) = line.find(" worker at ") {
            let rest = &line[at + " worker at ".len()..];
            worker_urls.push(rest.split(' ').next().unwrap().to_string());
        }
        if line.starts_with("Ctrl-C stops everything") {
            break;
        }
    }
    // The default stack is disaggregated: one prefill and one decode worker.
    assert_eq!(worker_urls.len(), 2, "{worker_urls:?}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let body: serde_json::Value = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
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

    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "up did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status}");
    // Its children are gone too: nothing answers on the workers' ports any more.
    for url in &worker_urls {
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
