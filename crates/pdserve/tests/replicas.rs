//! Gateway replicas: two `pdserve gateway` processes with the same flags on one discovery
//! listing route every turn of a conversation to the same decode worker whichever of them
//! a client reaches, and give the same greedy answers.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Kills the child if the test fails before it exits on its own.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    pdserve_http_server::free_local_port().unwrap()
}

fn spawn(args: &[String]) -> Reaper {
    Reaper(
        Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn wait_for(http: &reqwest::Client, url: &str, limit: Duration) {
    let start = Instant::now();
    while !http.get(url).send().await.is_ok_and(|r| r.status() == 200) {
        assert!(start.elapsed() < limit, "{url} not ready within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_listing_keep_a_session_on_one_decode_worker() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let model = model.to_string_lossy().into_owned();
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let worker = |role: &str, port: u16| {
            spawn(&[
                "worker".into(),
                "--role".into(),
                role.into(),
                "--port".into(),
                port.to_string(),
                "--threads".into(),
                "1".into(),
                "--num-kv-blocks".into(),
                "128".into(),
                "--model".into(),
                model.clone(),
            ])
        };
        let (p, d0, d1) = (free_port(), free_port(), free_port());
        let _workers = [worker("prefill", p), worker("decode", d0), worker("decode", d1)];
        let listing = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("replicas-{}.yaml", std::process::id()));
        std::fs::write(
            &listing,
            format!(
                "workers:\n  - {{url: http://127.0.0.1:{p}, role: prefill}}\n  \
                 - {{url: http://127.0.0.1:{d0}, role: decode}}\n  \
                 - {{url: http://127.0.0.1:{d1}, role: decode}}\n"
            ),
        )
        .unwrap();
        let gateway = |port: u16| {
            spawn(&[
                "gateway".into(),
                "--port".into(),
                port.to_string(),
                "--discover-file".into(),
                listing.to_string_lossy().into_owned(),
                "--discover-interval".into(),
                "0.2".into(),
                "--decode-policy".into(),
                "session".into(),
                "--expose-routing".into(),
            ])
        };
        let (g0, g1) = (free_port(), free_port());
        let _gateways = [gateway(g0), gateway(g1)];
        let replicas = [
            format!("http://127.0.0.1:{g0}"),
            format!("http://127.0.0.1:{g1}"),
        ];
        for base in &replicas {
            wait_for(&http, &format!("{base}/health"), Duration::from_secs(240)).await;
        }
        let mut owners = std::collections::BTreeSet::new();
        for session in 0..12 {
            let session = format!("conversation-{session}");
            let mut decoded_by = Vec::new();
            let mut answers = Vec::new();
            for turn in 0..3 {
                let base = &replicas[turn % 2];
                let response = http
                    .post(format!("{base}/v1/chat/completions"))
                    .header("x-session-id", &session)
                    .json(&json!({
                        "messages": [{"role": "user", "content": format!("Say hello to {session}.")}],
                        "max_tokens": 4,
                        "temperature": 0
                    }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200, "{session} turn {turn} via {base}");
                let decode = response
                    .headers()
                    .get("x-pdserve-decode")
                    .expect("--expose-routing names the decode worker")
                    .to_str()
                    .unwrap()
                    .to_string();
                let body: Value = response.json().await.unwrap();
                decoded_by.push(decode);
                answers.push(body["choices"][0]["message"]["content"].clone());
            }
            assert!(
                decoded_by.iter().all(|d| d == &decoded_by[0]),
                "{session} moved between decode workers across replicas: {decoded_by:?}"
            );
            assert!(
                answers.iter().all(|a| a == &answers[0]),
                "{session}: greedy answers differ across replicas: {answers:?}"
            );
            owners.insert(decoded_by[0].clone());
        }
        assert_eq!(owners.len(), 2, "sessions spread over both decode workers");
        let _ = std::fs::remove_file(&listing);
    })
    .await
    .expect("test exceeded its time limit");
}
