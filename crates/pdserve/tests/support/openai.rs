//! What the orchestrator tests share: OpenAI request bodies, folding a stream into a
//! plain answer, waiting on `/health`, and a `pdserve` child process.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A streamed answer folded into the shape of a non-streamed one.
pub fn sse_to_value(body: &str) -> Value {
    let mut text = String::new();
    let mut chat = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "error event: {chunk}");
        if let Some(choice) = chunk["choices"].get(0) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                chat = true;
                text.push_str(t);
            } else if let Some(t) = choice["text"].as_str() {
                text.push_str(t);
            }
        }
    }
    if chat {
        json!({"choices": [{"message": {"content": text}}]})
    } else {
        json!({"choices": [{"text": text}]})
    }
}

pub fn text_of(v: &Value) -> String {
    let choice = &v["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

pub fn chat(content: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12, "temperature": 0, "stream": stream,
    })
}

pub fn completion(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream})
}

pub async fn wait_health(http: &reqwest::Client, base: &str, want: u16, limit: Duration) -> Value {
    let started = Instant::now();
    loop {
        if let Ok(response) = http.get(format!("{base}/health")).send().await {
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if status == want {
                return body;
            }
        }
        assert!(
            started.elapsed() < limit,
            "{base}/health never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `pdserve` process, killed when dropped.
pub struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    pub fn spawn(args: &[&str]) -> Self {
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("orchestrator-prefill.log");
        let child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self { child, log }
    }

    pub async fn wait_healthy(&mut self, http: &reqwest::Client, base: &str) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("exited early ({status}); log: {}", self.log.display());
            }
            if let Ok(r) = http.get(format!("{base}/health")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(240),
                "{base} never ready"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL: no drain, no goodbye.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}
