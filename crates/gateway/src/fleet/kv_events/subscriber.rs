//! One worker's event stream: a ZeroMQ SUB socket on its publisher, sequence numbers
//! checked, gaps filled from its replay socket. What cannot be trusted — a gap replay
//! cannot fill, a publisher that restarted (its sequence went back), a changed block
//! size — clears the worker's index, which then fills again from new events, and is
//! said in the log and in `pdserve_gateway_kv_index_rebuilds_total`. Nothing a publisher
//! sends can crash the task: bad frames and undecodable payloads are counted and skipped.
//! A stream that falls silent while the worker is sent prompts to compute (events owed
//! for longer than `--kv-events-stale-secs`) marks the index stale: it is cleared,
//! routing stops trusting it, and the next batch revives it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdserve_protocol::kv_events::{decode, KvCacheEvent, END_OF_REPLAY};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::{KvEventMetrics, WorkerEvents};

/// Where a worker's events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventEndpoints {
    /// The PUB socket (`tcp://host:port`).
    pub publisher: String,
    /// The ROUTER replay socket, when the worker has one.
    pub replay: Option<String>,
}

/// How long a replay may take before it counts as failed.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between attempts to connect to a publisher that is not there.
const RECONNECT_DELAY: Duration = Duration::from_millis(500);
/// How often owed events are checked for (a share of the stale time, at most 1 s).
const STALE_CHECKS_PER_PERIOD: u32 = 4;

/// Follows `endpoints` into `events` until aborted; the index goes stale when events are
/// owed for longer than `stale_after`.
pub async fn follow(
    worker: String,
    endpoints: EventEndpoints,
    events: Arc<WorkerEvents>,
    metrics: Arc<KvEventMetrics>,
    stale_after: Duration,
) {
    let mut stream = Stream::new(worker, endpoints, events, metrics, stale_after);
    let check_every = (stale_after / STALE_CHECKS_PER_PERIOD).min(Duration::from_secs(1));
    let mut stale_check = tokio::time::interval(check_every);
    stale_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut sub = SubSocket::new();
        let connected = async {
            sub.connect(&stream.endpoints.publisher).await?;
            sub.subscribe("").await
        };
        if let Err(e) = connected.await {
            stream.metrics.error(&stream.worker, "connect");
            tracing::debug!(worker = %stream.worker, endpoint = %stream.endpoints.publisher, "KV events: cannot subscribe yet: {e}");
            stream.check_stale();
            tokio::time::sleep(RECONNECT_DELAY).await;
            continue;
        }
        tracing::info!(worker = %stream.worker, endpoint = %stream.endpoints.publisher, "subscribed to KV events");
        loop {
            // A SUB socket's recv is a poll of its incoming queue: dropping it for a
            // tick loses no message.
            tokio::select! {
                received = sub.recv() => match received {
                    Ok(message) => stream.receive(message).await,
                    Err(e) => {
                        stream.metrics.error(&stream.worker, "receive");
                        tracing::warn!(worker = %stream.worker, "KV events: the subscription broke ({e}); reconnecting");
                        break;
                    }
                },
                _ = stale_check.tick() => stream.check_stale(),
            }
        }
        tokio::time::sleep(RECONNECT_DELAY).await;
    }
}

/// One worker's stream state: the sequence it is at, and its index.
pub(super) struct Stream {
    worker: String,
    endpoints: EventEndpoints,
    events: Arc<WorkerEvents>,
    metrics: Arc<KvEventMetrics>,
    /// The next sequence number; `None` before the first message.
    expected: Option<u64>,
    stale_after: Duration,
}

impl Stream {
    /// A stream not heard from yet.
    pub(super) fn new(
        worker: String,
        endpoints: EventEndpoints,
        events: Arc<WorkerEvents>,
        metrics: Arc<KvEventMetrics>,
        stale_after: Duration,
    ) -> Self {
        metrics.set_stale(&worker, false);
        Self {
            worker,
            endpoints,
            events,
            metrics,
            expected: None,
            stale_after,
        }
    }

    /// The index this stream fills.
    pub(super) fn events(&self) -> &Arc<WorkerEvents> {
        &self.events
    }

    /// Clears the index when its events have been owed too long.
    pub(super) fn check_stale(&self) {
        if self.events.check_stale(self.stale_after) {
            self.rebuild(
                "stale",
                &format!(
                    "the worker was sent prompts to compute and its stream said nothing for {:?}; routing falls back until it does",
                    self.stale_after
                ),
            );
            self.metrics.set_stale(&self.worker, true);
        }
    }

    async fn receive(&mut self, message: ZmqMessage) {
        self.receive_frames(message.into_vec()).await;
    }

    /// Applies one `[topic, seq, payload]` message.
    pub(super) async fn receive_frames(&mut self, frames: Vec<Bytes>) {
        let [_topic, seq, payload] = frames.as_slice() else {
            self.metrics.error(&self.worker, "frames");
            tracing::warn!(worker = %self.worker, frames = frames.len(), "KV events: a message is [topic, seq, payload]; skipped");
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.metrics.error(&self.worker, "frames");
            tracing::warn!(worker = %self.worker, "KV events: a sequence number is 8 bytes; skipped");
            return;
        };
        match self.expected {
            None if seq > 0 => {
                // Joined mid-stream: what the publisher still keeps fills the index.
                self.catch_up(0, seq, false).await;
            }
            None => {}
            Some(expected) if seq == expected => {}
            Some(expected) if seq > expected => {
                self.metrics.gap(&self.worker);
                tracing::info!(worker = %self.worker, expected, got = seq, "KV events: sequence gap; replaying");
                self.catch_up(expected, seq, true).await;
            }
            Some(expected) => {
                self.rebuild(
                    "restart",
                    &format!(
                        "the publisher restarted (sequence {seq} after {})",
                        expected - 1
                    ),
                );
            }
        }
        self.apply(seq, payload);
    }

    /// Replays `from..until` and applies it; when `required` and the replay cannot give
    /// all of it, the index is rebuilt instead.
    async fn catch_up(&mut self, from: u64, until: u64, required: bool) {
        let replayed = match &self.endpoints.replay {
            Some(replay) => {
                match tokio::time::timeout(REPLAY_TIMEOUT, replay_range(replay, from)).await {
                    Ok(Ok(batches)) => batches,
                    Ok(Err(e)) => {
                        self.metrics.replay(&self.worker, "failed");
                        tracing::warn!(worker = %self.worker, "KV events: replay failed: {e}");
                        Vec::new()
                    }
                    Err(_) => {
                        self.metrics.replay(&self.worker, "failed");
                        tracing::warn!(worker = %self.worker, "KV events: replay timed out");
                        Vec::new()
                    }
                }
            }
            None => Vec::new(),
        };
        let wanted: Vec<(u64, Bytes)> = replayed
            .into_iter()
            .filter(|(seq, _)| (from..until).contains(seq))
            .collect();
        let complete = wanted.len() as u64 == until - from
            && wanted
                .iter()
                .zip(from..)
                .all(|((seq, _), want)| *seq == want);
        if self.endpoints.replay.is_some() {
            self.metrics
                .replay(&self.worker, if complete { "filled" } else { "incomplete" });
        }
        if required && !complete {
            let why = match &self.endpoints.replay {
                Some(_) => format!("a replay could not fill sequences {from}..{until}"),
                None => {
                    format!("sequences {from}..{until} were missed and there is no replay endpoint")
                }
            };
            self.rebuild("gap", &why);
            return;
        }
        for (seq, payload) in wanted {
            self.apply(seq, &payload);
        }
    }

    /// Clears the index: from here on it holds only what new events say.
    fn rebuild(&self, reason: &'static str, why: &str) {
        self.metrics.rebuild(&self.worker, reason);
        tracing::warn!(worker = %self.worker, reason, "KV index cleared and rebuilt from new events: {why}");
        self.events.reset();
        self.metrics.set_blocks(&self.worker, 0);
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.expected = Some(seq + 1);
        let decoded = match decode(payload) {
            Ok(decoded) => decoded,
            Err(e) => {
                self.metrics.error(&self.worker, "payload");
                tracing::warn!(worker = %self.worker, seq, "KV events: {e}; skipped");
                return;
            }
        };
        for why in &decoded.skipped {
            self.metrics.event(&self.worker, "skipped");
            tracing::debug!(worker = %self.worker, seq, "KV events: event skipped: {why}");
        }
        let mut index = self.events.lock();
        for event in &decoded.batch.events {
            self.metrics.event(&self.worker, kind(event));
            if let Err(fault) = index.apply(event) {
                drop(index);
                self.rebuild("block_size", &fault.to_string());
                index = self.events.lock();
                // The new engine's events start the index afresh.
                let _ = index.apply(event);
            }
        }
        let blocks = index.len();
        drop(index);
        if self.events.is_stale() {
            tracing::info!(worker = %self.worker, "KV events: the stream speaks again; its index is trusted");
            self.metrics.set_stale(&self.worker, false);
        }
        self.events.heard(Instant::now());
        self.metrics.set_blocks(&self.worker, blocks);
    }
}

fn kind(event: &KvCacheEvent) -> &'static str {
    match event {
        KvCacheEvent::BlockStored { .. } => "block_stored",
        KvCacheEvent::BlockRemoved { .. } => "block_removed",
        KvCacheEvent::AllBlocksCleared => "all_blocks_cleared",
    }
}

/// Every batch the publisher keeps from `from` on, as `(seq, payload)`, in its order.
async fn replay_range(endpoint: &str, from: u64) -> zeromq::ZmqResult<Vec<(u64, Bytes)>> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(request).await?;
    let mut batches = Vec::new();
    loop {
        let frames = dealer.recv().await?.into_vec();
        // ["", seq, payload] (the ROUTER keeps the delimiter it was sent); vLLM 0.32 puts
        // the topic before the sequence: ["", topic, seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [empty, _topic, seq, payload] if empty.is_empty() => (seq, payload),
            [empty, seq, payload] if empty.is_empty() => (seq, payload),
            [seq, payload] => (seq, payload),
            _ => continue,
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(i64::from_be_bytes) else {
            continue;
        };
        if seq == END_OF_REPLAY {
            return Ok(batches);
        }
        batches.push((seq as u64, payload.clone()));
    }
}
