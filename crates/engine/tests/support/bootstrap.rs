//! SGLang's bootstrap handoff between test workers: a prefill worker with a bootstrap
//! port, a decode worker, and the bodies that name a room.

use serde_json::{json, Value};

use super::TestWorker;

/// What the tests give `--bootstrap-timeout-secs`: a room nobody meets closes this soon.
pub const ROOM_TIMEOUT_SECS: u64 = 3;

/// A prefill worker with a bootstrap port, a decode worker, and the bootstrap port; both
/// started with `extra` flags.
pub async fn bootstrap_pair(extra: &[&str]) -> (TestWorker, TestWorker, u16) {
    let timeout = ROOM_TIMEOUT_SECS.to_string();
    let shared = [&["--bootstrap-timeout-secs", timeout.as_str()][..], extra].concat();
    let p =
        TestWorker::start(&[&["--role", "prefill", "--bootstrap-port", "0"][..], &shared].concat())
            .await;
    let d = TestWorker::start(&[&["--role", "decode"][..], &shared].concat()).await;
    let (status, info) = p.get("/server_info").await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["disaggregation_mode"], "prefill");
    let port = info["bootstrap_port"].as_u64().expect("a bootstrap port") as u16;
    assert_eq!(info["disaggregation_bootstrap_port"], port);
    (p, d, port)
}

/// `body` with the bootstrap fields of `room` at the prefill worker's `port`.
pub fn with_room(body: &Value, port: u16, room: u64) -> Value {
    let mut body = body.clone();
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(port);
    body["bootstrap_room"] = json!(room);
    body
}

/// Waits until `w` holds nothing pinned, no room open and nothing running.
pub async fn assert_clean(w: &TestWorker) {
    w.wait_metric(super::kv::PINNED, 0.0).await;
    w.wait_metric("pdserve_kv_blocks_pinned", 0.0).await;
    w.wait_metric("pdserve_bootstrap_rooms_open", 0.0).await;
    w.wait_metric("pdserve_num_requests_running", 0.0).await;
}
