//! Draining a worker in process, over real HTTP on 127.0.0.1:0 with the default model:
//! open streams finish while new connections are refused, and `--shutdown-timeout`
//! bounds how long they may take. Tests run one at a time (each starts its own worker).

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use pdserve_engine::health::Unhealthy;
use pdserve_engine::Worker;
use pdserve_protocol::sse::{messages, SseError, SseMessage};
use serde_json::{json, Value};
use support::{serial, TestWorker};

/// What the SSE parser yields over a reqwest body.
type Event = Result<SseMessage, SseError<reqwest::Error>>;

/// A worker with room in its cache for the longest stream here, and `extra` flags; the
/// tests shut it down themselves.
async fn start(extra: &[&str]) -> (Worker, String) {
    let w = TestWorker::start(&[&["--num-kv-blocks", "256"][..], extra].concat()).await;
    (w.worker, w.base)
}

/// Opens a streamed completion of `max_tokens` tokens and returns its events once the
/// first one has arrived (so the request is surely in flight).
async fn open_stream(base: &str, max_tokens: u32) -> impl Stream<Item = Event> {
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({
            "prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": true,
            "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut events = Box::pin(messages(resp.bytes_stream()));
    let first = events.next().await.expect("a first event").unwrap();
    assert!(matches!(first, SseMessage::Data(_)), "{first:?}");
    events
}

/// The data events that follow, and whether the stream ended with `[DONE]`.
async fn rest(events: impl Stream<Item = Event>) -> (Vec<Value>, bool) {
    let mut data = Vec::new();
    let mut events = Box::pin(events);
    while let Some(event) = events.next().await {
        match event.expect("the stream breaks off cleanly") {
            SseMessage::Data(d) => data.push(serde_json::from_str(&d).unwrap()),
            SseMessage::Done => return (data, true),
        }
    }
    (data, false)
}

/// Waits (bounded) until connecting to `addr` is refused.
async fn wait_refused(addr: SocketAddr) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{addr} still accepts connections"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_open_streams_finish_and_refuses_new_connections() {
    serial(async {
        let (worker, base) = start(&["--shutdown-timeout", "120"]).await;
        let addr = worker.local_addr();
        let health = worker.health();
        assert_eq!(health.check(), Ok(()));
        let events = open_stream(&base, 64).await;
        let shutdown = tokio::spawn(worker.shutdown());
        wait_refused(addr).await;
        assert_eq!(health.check(), Err(Unhealthy::Draining));

        let (data, done) = rest(events).await;
        assert!(done, "the stream ends with [DONE]");
        assert!(data.iter().all(|d| d.get("error").is_none()), "{data:?}");
        let finish = data
            .iter()
            .find_map(|d| d["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("length"));
        let usage = &data.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], 64, "{usage}");

        tokio::time::timeout(Duration::from_secs(30), shutdown)
            .await
            .expect("shutdown ends once the stream is done")
            .unwrap()
            .expect("clean shutdown");
        assert_eq!(health.check(), Err(Unhealthy::SchedulerExited));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_ends_streams_that_outlast_it() {
    serial(async {
        let (worker, base) = start(&["--shutdown-timeout", "1"]).await;
        let max_tokens = 3000;
        let events = open_stream(&base, max_tokens).await;
        let started = Instant::now();
        let shutdown = tokio::spawn(worker.shutdown());
        let (data, done) = rest(events).await;
        assert!(done, "the stream still ends with [DONE]");
        let error = data
            .iter()
            .find_map(|d| d.get("error"))
            .expect("an error event");
        assert!(
            error["message"].as_str().unwrap().contains("shutting down"),
            "{error}"
        );
        let text_chunks = data
            .iter()
            .filter(|d| d["choices"][0]["text"].is_string())
            .count();
        assert!(text_chunks < max_tokens as usize);
        tokio::time::timeout(Duration::from_secs(30), shutdown)
            .await
            .expect("shutdown is bounded")
            .unwrap()
            .expect("clean shutdown");
        let took = started.elapsed();
        // The timeout, then at most the flush grace; never the whole generation.
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(10),
            "{took:?}"
        );
    })
    .await;
}
