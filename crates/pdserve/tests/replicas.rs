//! Gateway replicas: two `pdserve gateway` processes with the same flags on one discovery
//! listing route every turn of a conversation to the same decode worker whichever of them
//! a client reaches, and give the same greedy answers; a Responses chain begun on one
//! continues on the other, which finds the stored response on its worker.

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

/// One prefill and two decode workers on a discovery listing, and two gateways on it.
struct Stack {
    _workers: [Reaper; 3],
    _gateways: [Reaper; 2],
    replicas: [String; 2],
    listing: std::path::PathBuf,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.listing);
    }
}

async fn start_stack(http: &reqwest::Client, name: &str) -> Stack {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let model = model.to_string_lossy().into_owned();
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
    let workers = [
        worker("prefill", p),
        worker("decode", d0),
        worker("decode", d1),
    ];
    let listing = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}.yaml", std::process::id()));
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
    let gateways = [gateway(g0), gateway(g1)];
    let replicas = [
        format!("http://127.0.0.1:{g0}"),
        format!("http://127.0.0.1:{g1}"),
    ];
    for base in &replicas {
        wait_for(http, &format!("{base}/health"), Duration::from_secs(240)).await;
    }
    Stack {
        _workers: workers,
        _gateways: gateways,
        replicas,
        listing,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_listing_keep_a_session_on_one_decode_worker() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let stack = start_stack(&http, "replicas").await;
        let replicas = &stack.replicas;
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
    })
    .await
    .expect("test exceeded its time limit");
}

/// `POST /v1/responses` with `body`: status, the decode worker that answered, the body.
async fn respond(http: &reqwest::Client, base: &str, body: Value) -> (u16, String, Value) {
    let response = http
        .post(format!("{base}/v1/responses"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let decode = response
        .headers()
        .get("x-pdserve-decode")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, decode, response.json().await.unwrap())
}

fn output_text(response: &Value) -> String {
    response["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_chain_begun_on_one_replica_continues_on_the_other() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let stack = start_stack(&http, "responses-replicas").await;
        let [a, b] = &stack.replicas;
        let turn = |previous: Option<&str>, input: &str| {
            let mut body = json!({"input": input, "max_output_tokens": 6, "temperature": 0});
            if let Some(previous) = previous {
                body["previous_response_id"] = json!(previous);
            }
            body
        };
        let (status, owner, first) = respond(&http, a, turn(None, "Name a color.")).await;
        assert_eq!(status, 200, "{first}");
        let id1 = first["id"].as_str().unwrap().to_string();

        // Through the gateway that relayed turn 1: P/D, the conversation written out.
        let next = turn(Some(&id1), "And another one?");
        let (status, via_a_decode, via_a) = respond(&http, a, next.clone()).await;
        assert_eq!(status, 200, "{via_a}");
        assert_eq!(via_a_decode, owner, "the turn goes back to the owner");
        assert_eq!(via_a["previous_response_id"], id1.as_str());
        assert!(
            via_a["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            "turn 2 reuses turn 1's KV: {via_a}"
        );
        // Through the other gateway, which never saw turn 1: it finds the response on
        // its worker, which serves the turn alone, with the same greedy answer.
        let (status, via_b_decode, via_b) = respond(&http, b, next).await;
        assert_eq!(status, 200, "{via_b}");
        assert_eq!(via_b_decode, owner, "only the owner holds the conversation");
        assert_eq!(via_b["previous_response_id"], id1.as_str());
        assert_eq!(output_text(&via_b), output_text(&via_a));
        assert_eq!(
            via_b["usage"]["input_tokens"],
            via_a["usage"]["input_tokens"]
        );

        // Retrieve and delete through the gateway that did not relay it.
        let id2 = via_b["id"].as_str().unwrap();
        let got: Value = http
            .get(format!("{a}/v1/responses/{id2}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["id"], id2);
        assert_eq!(output_text(&got), output_text(&via_b));
        let deleted = http
            .delete(format!("{a}/v1/responses/{id2}"))
            .send()
            .await
            .unwrap();
        assert_eq!(deleted.status(), 200);
        let gone = http
            .get(format!("{b}/v1/responses/{id2}"))
            .send()
            .await
            .unwrap();
        assert_eq!(gone.status(), 404);
        let gone: Value = gone.json().await.unwrap();
        assert_eq!(gone["error"]["param"], "response_id");

        // An id no worker holds is OpenAI's 404, on either replica.
        for base in [a, b] {
            let (status, _, error) = respond(&http, base, turn(Some("resp_nope"), "hi")).await;
            assert_eq!(status, 404, "{error}");
            assert_eq!(error["error"]["param"], "previous_response_id");
        }

        // A streamed third turn through P/D: the Responses events, ending with
        // response.completed (no [DONE], no error event), the chain's id written in.
        let id2a = via_a["id"].as_str().unwrap();
        let mut streamed = turn(Some(id2a), "One more?");
        streamed["stream"] = json!(true);
        let text = http
            .post(format!("{a}/v1/responses"))
            .json(&streamed)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let types: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| {
                serde_json::from_str::<Value>(d).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(
            types.first().map(String::as_str),
            Some("response.created"),
            "{text}"
        );
        let last = types.last().unwrap();
        assert!(
            last == "response.completed" || last == "response.incomplete",
            "{text}"
        );
        assert!(!types.iter().any(|t| t == "error"), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
        assert!(
            !text.contains("kv_transfer_params"),
            "handles never reach the client"
        );
        assert!(
            text.contains(&format!("\"previous_response_id\":\"{id2a}\"")),
            "{text}"
        );
    })
    .await
    .expect("test exceeded its time limit");
}
