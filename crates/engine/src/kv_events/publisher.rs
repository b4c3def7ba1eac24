//! The ZeroMQ side of KV events, as vLLM's `ZmqEventPublisher` does it: a PUB socket
//! sending `[topic, seq (8 bytes, big-endian), msgpack KVEventBatch]`, numbered from 0,
//! and an optional ROUTER socket that answers an 8-byte start sequence with every kept
//! batch from there (`[seq, payload]` each) and then the end marker (`seq` −1, empty
//! payload).
//!
//! The PUB socket binds or connects by vLLM's rule ([`KvEventsConfig::binds`]). A
//! connecting one (to a collector such as a gateway's `--kv-events-bind`) never holds
//! the worker up: it connects in the background, as libzmq does, retries until the
//! collector listens and reconnects when it goes away; batches published meanwhile are
//! numbered and kept for replay but reach no one.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use pdserve_protocol::kv_events::{encode, KvCacheEvent, KvEventBatch, END_OF_REPLAY};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{
    PubSocket, RouterSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage,
};

use super::config::bind_address;
use super::{to_events, CacheNews, EventSink, KvEventsConfig};

/// The messages a ZeroMQ PUB socket of this implementation queues per subscriber.
const PUB_QUEUE: usize = 100_000;
/// How long one attempt to reach a collector may take, and the pause between attempts.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A socket could not bind or connect.
    #[error("KV events: cannot open {endpoint}: {source}")]
    Socket {
        /// The endpoint.
        endpoint: String,
        /// What ZeroMQ said.
        source: zeromq::ZmqError,
    },
}

/// A running publisher.
pub struct Publisher {
    /// Where subscribers connect (the bound address; the configured one when connecting).
    pub endpoint: String,
    /// Where replay requests go, when there is a replay socket.
    pub replay_endpoint: Option<String>,
    sink: EventSink,
    task: JoinHandle<()>,
    /// Socket files this publisher bound (removed when it stops, as libzmq does).
    ipc_paths: Vec<std::path::PathBuf>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
        for path in &self.ipc_paths {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Binds `socket` to `endpoint` and returns the bound endpoint: ZeroMQ's wildcard host
/// `*` binds every interface; a socket file an earlier process left at an `ipc://` path
/// is replaced, as libzmq does.
async fn bind(
    socket: &mut impl Socket,
    endpoint: &str,
    ipc_paths: &mut Vec<std::path::PathBuf>,
) -> Result<String, PublisherError> {
    let address = bind_address(endpoint);
    let ipc_path = address.strip_prefix("ipc://").map(std::path::PathBuf::from);
    if let Some(path) = &ipc_path {
        remove_stale_socket(path);
    }
    let bound = socket
        .bind(&address)
        .await
        .map_err(|source| PublisherError::Socket {
            endpoint: endpoint.to_string(),
            source,
        })?;
    ipc_paths.extend(ipc_path);
    Ok(bound.to_string())
}

/// Removes a Unix socket file at `path` (never any other kind of file).
fn remove_stale_socket(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(path);
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

impl Publisher {
    /// Opens the sockets and starts publishing what the returned sink receives.
    pub async fn start(config: KvEventsConfig) -> Result<Self, PublisherError> {
        let mut ipc_paths = Vec::new();
        let (publisher, endpoint, collector) = if config.binds() {
            let mut publisher = PubSocket::new();
            let endpoint = bind(&mut publisher, &config.endpoint, &mut ipc_paths).await?;
            (publisher, endpoint, None)
        } else {
            let mut options = SocketOptions::default();
            options.connect_timeout(CONNECT_ATTEMPT);
            let mut publisher = PubSocket::with_options(options);
            let monitor = publisher.monitor();
            (
                publisher,
                config.endpoint.clone(),
                Some(Collector {
                    endpoint: config.endpoint.clone(),
                    connected: false,
                    monitor,
                    failures: 0,
                }),
            )
        };
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            Some(wanted) => {
                let mut router = RouterSocket::new();
                let bound = bind(&mut router, wanted, &mut ipc_paths).await?;
                (Some(router), Some(bound))
            }
            None => (None, None),
        };
        if config.hwm != PUB_QUEUE {
            tracing::warn!(
                hwm = config.hwm,
                "KV events: this ZeroMQ implementation queues {PUB_QUEUE} messages per \
                 subscriber whatever hwm says"
            );
        }
        let (tx, rx) = mpsc::channel(config.max_queue_size);
        let dropped = Arc::new(AtomicU64::new(0));
        let sink = EventSink {
            tx,
            dropped: dropped.clone(),
        };
        let sockets = Sockets {
            publisher,
            replay,
            collector,
            topic: Bytes::from(config.topic.clone().into_bytes()),
            kept: VecDeque::new(),
            keep: config.buffer_steps,
            next_seq: 0,
            dropped,
        };
        tracing::info!(
            %endpoint,
            mode = if config.binds() { "bind" } else { "connect" },
            replay = replay_endpoint.as_deref().unwrap_or("(none)"),
            topic = %config.topic,
            "publishing KV events"
        );
        let task = tokio::spawn(sockets.run(rx));
        Ok(Self {
            endpoint,
            replay_endpoint,
            sink,
            task,
            ipc_paths,
        })
    }

    /// The queue the scheduler sends its changes into.
    pub fn sink(&self) -> EventSink {
        self.sink.clone()
    }
}

/// A connecting PUB socket's link to its collector.
struct Collector {
    endpoint: String,
    connected: bool,
    /// The PUB socket's events: a disconnect means connecting again.
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    /// Attempts failed since the last connection (the first is logged at warn).
    failures: u32,
}

struct Sockets {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
    collector: Option<Collector>,
    topic: Bytes,
    /// The last `keep` batches, for replay.
    kept: VecDeque<(u64, Bytes)>,
    keep: usize,
    next_seq: u64,
    dropped: Arc<AtomicU64>,
}

impl Sockets {
    async fn run(mut self, mut news: mpsc::Receiver<CacheNews>) {
        let mut reported_drops = 0;
        let mut reconnect = tokio::time::interval(CONNECT_ATTEMPT);
        reconnect.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let unconnected = self.collector.as_ref().is_some_and(|c| !c.connected);
            tokio::select! {
                _ = reconnect.tick(), if unconnected => self.connect().await,
                event = next_event(&mut self.collector) => {
                    if let (Some(SocketEvent::Disconnected(_)), Some(collector)) =
                        (event, self.collector.as_mut())
                    {
                        collector.connected = false;
                        tracing::warn!(collector = %collector.endpoint, "KV events: the collector went away; reconnecting");
                    }
                }
                item = news.recv() => {
                    let Some(item) = item else { return };
                    let events = match item {
                        CacheNews::Cleared => vec![KvCacheEvent::AllBlocksCleared],
                        CacheNews::Changes(changes) => to_events(&changes),
                    };
                    if !events.is_empty() {
                        self.publish(events).await;
                    }
                    let dropped = self.dropped.load(Ordering::Relaxed);
                    if dropped > reported_drops {
                        tracing::warn!(dropped, "KV events dropped: the publisher fell behind max_queue_size");
                        reported_drops = dropped;
                    }
                }
                request = next_request(&mut self.replay) => match request {
                    Ok(request) => self.replay(request).await,
                    Err(e) => tracing::warn!("KV events replay socket: {e}"),
                },
            }
        }
    }

    /// One attempt to reach the collector.
    async fn connect(&mut self) {
        let Some(collector) = self.collector.as_mut() else {
            return;
        };
        match tokio::time::timeout(
            CONNECT_ATTEMPT * 2,
            self.publisher.connect(&collector.endpoint),
        )
        .await
        {
            Ok(Ok(())) => {
                collector.connected = true;
                collector.failures = 0;
                tracing::info!(collector = %collector.endpoint, "KV events: connected to the collector");
            }
            Ok(Err(e)) => collector.failed(&e.to_string()),
            Err(_) => collector.failed("timed out"),
        }
    }

    async fn publish(&mut self, events: Vec<KvCacheEvent>) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        let payload = Bytes::from(encode(&KvEventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
        }));
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut message = ZmqMessage::from(self.topic.clone());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(payload.clone());
        if let Err(e) = self.publisher.send(message).await {
            tracing::warn!(seq, "KV events: publishing failed: {e}");
        }
        if self.keep > 0 {
            if self.kept.len() == self.keep {
                self.kept.pop_front();
            }
            self.kept.push_back((seq, payload));
        }
    }

    /// Answers `[identity, "", start]` (a REQ or DEALER client; the delimiter may be
    /// left out) with every kept batch from `start` on, then the end marker.
    async fn replay(&mut self, request: ZmqMessage) {
        let frames = request.into_vec();
        let (identity, delimited, start) = match frames.as_slice() {
            [identity, empty, start] if empty.is_empty() => (identity.clone(), true, start),
            [identity, start] => (identity.clone(), false, start),
            _ => {
                tracing::warn!(
                    frames = frames.len(),
                    "KV events: a replay request is [identity, \"\", start]"
                );
                return;
            }
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            tracing::warn!("KV events: a replay start is 8 big-endian bytes");
            return;
        };
        let Some(router) = self.replay.as_mut() else {
            return;
        };
        let reply = |seq: Bytes, payload: Bytes| {
            let mut message = ZmqMessage::from(identity.clone());
            if delimited {
                message.push_back(Bytes::new());
            }
            message.push_back(seq);
            message.push_back(payload);
            message
        };
        for (seq, payload) in self.kept.iter().filter(|(seq, _)| *seq >= start) {
            let frame = Bytes::copy_from_slice(&seq.to_be_bytes());
            if router.send(reply(frame, payload.clone())).await.is_err() {
                return;
            }
        }
        let end = Bytes::copy_from_slice(&END_OF_REPLAY.to_be_bytes());
        let _ = router.send(reply(end, Bytes::new())).await;
    }
}

impl Collector {
    fn failed(&mut self, why: &str) {
        if self.failures == 0 {
            tracing::warn!(collector = %self.endpoint, "KV events: cannot reach the collector yet ({why}); retrying every {CONNECT_ATTEMPT:?}");
        } else {
            tracing::debug!(collector = %self.endpoint, "KV events: cannot reach the collector: {why}");
        }
        self.failures += 1;
    }
}

/// The next event of a connecting PUB socket; never, when it binds.
async fn next_event(collector: &mut Option<Collector>) -> Option<SocketEvent> {
    use futures::StreamExt;
    match collector {
        Some(collector) => match collector.monitor.next().await {
            Some(event) => Some(event),
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

async fn next_request(replay: &mut Option<RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pdserve_protocol::kv_events::decode;
    use zeromq::{DealerSocket, SubSocket};

    use super::*;
    use crate::block_manager::{BlockHash, CacheChange};

    fn stored(h: u64, parent: Option<u64>) -> CacheChange {
        CacheChange::Stored {
            hash: BlockHash(h),
            parent: parent.map(BlockHash),
            tokens: [h as u32; pdserve_model::BLOCK_SIZE],
        }
    }

    /// A fresh folder for socket files, removed when dropped.
    struct SocketDir(std::path::PathBuf);

    impl SocketDir {
        fn path(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for SocketDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn socket_dir() -> SocketDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pdserve-kvev-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        SocketDir(dir)
    }

    fn ipc(dir: &SocketDir, name: &str) -> String {
        format!("ipc://{}", dir.path().join(name).display())
    }

    #[tokio::test]
    async fn batches_are_numbered_published_and_replayed() {
        // ipc:// binds (vLLM's rule), so nothing listens on the network.
        let dir = socket_dir();
        let publisher = Publisher::start(KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: ipc(&dir, "pub.sock"),
            replay_endpoint: Some(ipc(&dir, "replay.sock")),
            topic: "kv@test".into(),
            buffer_steps: 2,
            ..KvEventsConfig::default()
        })
        .await
        .unwrap();
        let mut sub = SubSocket::new();
        sub.connect(&publisher.endpoint).await.unwrap();
        sub.subscribe("kv@").await.unwrap();
        // A PUB socket drops what it sends before the subscription arrives.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let sink = publisher.sink();
        sink.send(CacheNews::Cleared);
        sink.send(CacheNews::Changes(vec![
            stored(1, None),
            stored(2, Some(1)),
        ]));
        sink.send(CacheNews::Changes(vec![]));
        sink.send(CacheNews::Changes(vec![CacheChange::Removed {
            hash: BlockHash(1),
        }]));
        let mut seen = Vec::new();
        for expected_seq in 0u64..3 {
            let message = next(&mut sub).await;
            assert_eq!(message.len(), 3);
            assert_eq!(&message[0][..], b"kv@test");
            assert_eq!(&message[1][..], &expected_seq.to_be_bytes());
            let batch = decode(&message[2]).unwrap().batch;
            assert_eq!(batch.data_parallel_rank, Some(0));
            seen.push(batch.events);
        }
        assert_eq!(seen[0], vec![KvCacheEvent::AllBlocksCleared]);
        assert!(
            matches!(&seen[1][..], [KvCacheEvent::BlockStored { block_hashes, .. }] if block_hashes.len() == 2)
        );
        assert!(matches!(&seen[2][..], [KvCacheEvent::BlockRemoved { .. }]));

        // Replay from 0: only the last two batches are kept, then the end marker.
        let mut dealer = DealerSocket::new();
        dealer
            .connect(publisher.replay_endpoint.as_deref().unwrap())
            .await
            .unwrap();
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&0u64.to_be_bytes()));
        dealer.send(request).await.unwrap();
        let mut replayed = Vec::new();
        loop {
            let frames = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
                .await
                .expect("a replay answer within 5 s")
                .unwrap()
                .into_vec();
            assert_eq!(frames.len(), 3, "[\"\", seq, payload]");
            let seq = i64::from_be_bytes(frames[1][..].try_into().unwrap());
            if seq == END_OF_REPLAY {
                assert!(frames[2].is_empty());
                break;
            }
            replayed.push(seq);
            decode(&frames[2]).unwrap();
        }
        assert_eq!(replayed, vec![1, 2]);
    }

    #[tokio::test]
    async fn a_wildcard_binds_every_interface() {
        let publisher = Publisher::start(KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: "tcp://*:0".into(),
            ..KvEventsConfig::default()
        })
        .await
        .expect("tcp://*:PORT binds, as vLLM's default does");
        let port = publisher
            .endpoint
            .strip_prefix("tcp://0.0.0.0:")
            .unwrap_or_else(|| panic!("{}", publisher.endpoint));
        // Every interface: loopback too.
        let mut sub = SubSocket::new();
        sub.connect(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        let sink = publisher.sink();
        let message = loop {
            sink.send(CacheNews::Cleared);
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
                break m.unwrap().into_vec();
            }
        };
        assert_eq!(message.len(), 3);
    }

    #[tokio::test]
    async fn an_ipc_socket_file_left_behind_is_replaced_and_removed_at_stop() {
        let dir = socket_dir();
        let endpoint = ipc(&dir, "pub.sock");
        let path = dir.path().join("pub.sock");
        // A socket file an earlier, killed process left.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let publisher = Publisher::start(KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: endpoint.clone(),
            ..KvEventsConfig::default()
        })
        .await
        .expect("a stale socket file is replaced");
        assert_eq!(publisher.endpoint, endpoint);
        drop(publisher);
        assert!(!path.exists(), "the socket file goes with the publisher");
    }

    /// Reads one message within 5 s.
    async fn next(sub: &mut SubSocket) -> Vec<Bytes> {
        tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("a batch within 5 s")
            .unwrap()
            .into_vec()
    }

    #[tokio::test]
    async fn a_concrete_endpoint_connects_to_a_collector_that_comes_later_and_comes_back() {
        // Reserve a loopback port for the collector, which is not listening yet.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let publisher = tokio::time::timeout(
            Duration::from_secs(2),
            Publisher::start(KvEventsConfig {
                enable_kv_cache_events: true,
                endpoint: endpoint.clone(),
                topic: "kv@127.0.0.1:8000@m".into(),
                ..KvEventsConfig::default()
            }),
        )
        .await
        .expect("a worker never waits for its collector")
        .expect("no collector yet is no error");
        assert_eq!(publisher.endpoint, endpoint);
        let sink = publisher.sink();

        for round in 0..2 {
            // The collector binds; the publisher reaches it within its retry period.
            let mut collector = SubSocket::new();
            collector.bind(&endpoint).await.unwrap();
            collector.subscribe("").await.unwrap();
            let message = loop {
                sink.send(CacheNews::Changes(vec![stored(round + 1, None)]));
                match tokio::time::timeout(Duration::from_millis(300), collector.recv()).await {
                    Ok(message) => break message.unwrap().into_vec(),
                    Err(_) => continue,
                }
            };
            assert_eq!(&message[0][..], b"kv@127.0.0.1:8000@m", "round {round}");
            let batch = decode(&message[2]).unwrap().batch;
            assert!(matches!(
                &batch.events[..],
                [KvCacheEvent::BlockStored { .. }]
            ));
            // The collector goes away (a gateway restart): the next one is reached too.
            drop(collector);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
