//! Bar D2-durable-history: two gateway replicas share one PostgreSQL (a server of the
//! test's own, on 127.0.0.1) in front of one P/D pair, `pdserve up --gateway-replicas 2
//! --history-backend postgres`.
//!
//! - A `previous_response_id` chain whose turns alternate between the replicas answers,
//!   turn by turn, what one aggregated worker answers to the same chain (greedy); the
//!   decode worker's KV handle, kept with each turn in the database, is the next turn's
//!   fast path on either replica.
//! - A turn stored through one replica is retrieved through the other.
//! - A restarted stack (new gateways, new workers) continues the chain from the database:
//!   the old handle names a worker that is gone, so the turn is computed in full, with the
//!   same answer.
//! - A gateway killed mid-turn leaves no half-written turn: neither the response nor any
//!   of its items in the conversation it was a turn of.
//! - With the database down, a turn that needs history is a prompt 503 that says so, a
//!   stateless request is served as before, and once the database is back the chain
//!   continues without a restart.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "support/up.rs"]
mod up;
#[path = "support/worker.rs"]
mod worker;

use up::Up;

/// The chain's inputs, one per turn.
const TURNS: [&str; 4] = [
    "My name is Ada. Say hello.",
    "What is my name?",
    "Name a colour.",
    "And one more?",
];

fn turn(input: &str, previous: Option<&str>) -> Value {
    let mut body = json!({"input": input, "max_output_tokens": 8, "temperature": 0});
    if let Some(previous) = previous {
        body["previous_response_id"] = json!(previous);
    }
    body
}

fn output_text(response: &Value) -> String {
    let mut text = String::new();
    for item in response["output"].as_array().into_iter().flatten() {
        for part in item["content"].as_array().into_iter().flatten() {
            text.push_str(part["text"].as_str().unwrap_or_default());
        }
    }
    text
}

async fn respond(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let response = http
        .post(format!("{base}/v1/responses"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The chain's answers from one aggregated worker that stores it itself.
async fn reference_answers(http: &reqwest::Client, model: &std::path::Path) -> Vec<String> {
    let (_worker, base) = worker::start_worker("both", model, &[]).await;
    let mut previous: Option<String> = None;
    let mut answers = Vec::new();
    for input in TURNS {
        let (status, body) = respond(http, &base, &turn(input, previous.as_deref())).await;
        assert_eq!(status, 200, "reference worker: {body}");
        answers.push(output_text(&body));
        previous = body["id"].as_str().map(str::to_string);
    }
    answers
}

/// The second replica of `up` (on the port after its entry's).
fn second_replica(up: &Up) -> String {
    let port: u16 = up.entry.rsplit(':').next().unwrap().parse().unwrap();
    format!("http://127.0.0.1:{}", port + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_postgres_share_a_chain_that_survives_a_restart() {
    let Some(mut db) = pdserve_history::local_postgres::start_for_test("durable_history (D2 bar)")
    else {
        return;
    };
    let url = db.url();
    tokio::time::timeout(Duration::from_secs(600), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
        let want = reference_answers(&http, &model).await;
        let flags = [
            "--gateway-replicas",
            "2",
            "--history-backend",
            "postgres",
            "--history-url",
            &url,
            "--gateway-arg=--history-timeout-ms",
            "--gateway-arg=1500",
        ];
        let up = Up::start(&model, &flags);
        let replicas = [up.entry.clone(), second_replica(&up)];

        // Turns 1 to 3, alternating replicas.
        let mut ids: Vec<String> = Vec::new();
        for (i, input) in TURNS[..3].iter().enumerate() {
            let base = &replicas[i % 2];
            let (status, body) =
                respond(&http, base, &turn(input, ids.last().map(String::as_str))).await;
            assert_eq!(status, 200, "turn {} via {base}: {body}", i + 1);
            assert_eq!(output_text(&body), want[i], "turn {} via {base}", i + 1);
            if let Some(previous) = ids.last() {
                assert_eq!(body["previous_response_id"], previous.as_str());
            }
            ids.push(body["id"].as_str().unwrap().to_string());
        }

        // Turns 2 and 3 continued a turn the other replica relayed: their prefill read the
        // last decode's blocks with the handle kept in the database.
        for base in &replicas {
            let metrics = http
                .get(format!("{base}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let hits = metrics
                .lines()
                .find_map(|l| l.strip_prefix("pdserve_gateway_conversation_cache_hits_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            assert!(hits >= 1.0, "{base} read no kept handle:\n{metrics}");
        }

        // Stored through one replica, read through the other; unknown ids are 404s.
        let got: Value = http
            .get(format!("{}/v1/responses/{}", replicas[0], ids[1]))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["id"], ids[1].as_str());
        assert_eq!(output_text(&got), want[1]);
        assert_eq!(got["previous_response_id"], ids[0].as_str());
        let missing = http
            .get(format!("{}/v1/responses/resp_none", replicas[1]))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);
        let (status, error) = respond(&http, &replicas[1], &turn("hi", Some("resp_none"))).await;
        assert_eq!(status, 404, "{error}");
        assert_eq!(error["error"]["code"], "previous_response_not_found");

        killed_mid_turn_leaves_nothing(&http, &up, &url).await;

        // The database goes down: history is a prompt 503, stateless requests still work.
        db.stop().unwrap();
        let asked = Instant::now();
        let (status, error) = respond(&http, &replicas[0], &turn(TURNS[3], Some(&ids[2]))).await;
        assert_eq!(status, 503, "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("history store is unavailable"),
            "{error}"
        );
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "{:?}",
            asked.elapsed()
        );
        let (status, fresh) = respond(&http, &replicas[1], &turn("Say hi.", None)).await;
        assert_eq!(
            status, 200,
            "a stateless turn without the database: {fresh}"
        );

        // Back: the chain continues without restarting anything.
        db.start_again().unwrap();
        let back = Instant::now();
        let answered = loop {
            let (status, body) = respond(
                &http,
                &replicas[0],
                &turn("Say hello again.", Some(&ids[2])),
            )
            .await;
            if status == 200 {
                break body;
            }
            assert!(
                back.elapsed() < Duration::from_secs(20),
                "the store did not come back: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert_eq!(answered["previous_response_id"], ids[2].as_str());
        eprintln!(
            "history back after the database restart: {:?}",
            back.elapsed()
        );
        up.stop();

        // A new stack on the same database continues the chain (the stored handle names
        // a decode worker that is gone: the turn is computed in full).
        let up = Up::start(&model, &flags);
        let (status, last) =
            respond(&http, &second_replica(&up), &turn(TURNS[3], Some(&ids[2]))).await;
        assert_eq!(status, 200, "after the restart: {last}");
        assert_eq!(output_text(&last), want[3], "turn 4 after the restart");
        up.stop();
    })
    .await
    .expect("the D2 test ran past its time limit");
}

/// A third gateway on the same workers and database, killed (SIGKILL) while it streams a
/// conversation's turn: the turn is nowhere to be seen through the others.
async fn killed_mid_turn_leaves_nothing(http: &reqwest::Client, up: &Up, db_url: &str) {
    let conversation: Value = http
        .post(format!("{}/v1/conversations", up.entry))
        .json(&json!({"items": [{"role": "user", "content": "Count to fifty."}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let conversation = conversation["id"].as_str().unwrap().to_string();
    let port = up::free_port();
    let mut gateway = KilledOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["gateway", "--port", &port.to_string()])
            .args(["--prefill", &up.workers[0], "--decode", &up.workers[1]])
            .args(["--history-backend", "postgres", "--history-url", db_url])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    while http
        .get(format!("{base}/health"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .ok()
        != Some(200)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "gateway not ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let body = json!({"input": "Go on, slowly.", "conversation": conversation,
                      "max_output_tokens": 200, "temperature": 0, "stream": true});
    let mut stream = http
        .post(format!("{base}/v1/responses"))
        .json(&body)
        .send()
        .await
        .unwrap();
    // Read until the response has an id and some text has come, then kill the gateway.
    let mut seen = String::new();
    let id = loop {
        let chunk = tokio::time::timeout(Duration::from_secs(60), stream.chunk())
            .await
            .expect("the stream stalled")
            .unwrap()
            .expect("the stream ended before any text");
        seen.push_str(&String::from_utf8_lossy(&chunk));
        if seen.contains("response.output_text.delta") {
            let at = seen.find("\"resp_").expect("a response id") + 1;
            let end = at + seen[at..].find('"').unwrap();
            break seen[at..end].to_string();
        }
    };
    gateway.0.kill().unwrap();
    gateway.0.wait().unwrap();
    drop(stream);
    let gone = http
        .get(format!("{}/v1/responses/{id}", up.entry))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404, "a killed turn is not stored: {id}");
    let items: Value = http
        .get(format!(
            "{}/v1/conversations/{conversation}/items",
            up.entry
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        items["data"].as_array().unwrap().len(),
        1,
        "only the item the conversation began with: {items}"
    );
}

/// A child process killed when dropped, so a failed assertion leaves none behind.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
