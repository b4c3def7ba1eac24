//! The ZeroMQ side of KV events, as vLLM's `ZmqEventPublisher` does it: a PUB socket
//! sending `[topic, seq (8 bytes, big-endian), msgpack KVEventBatch]`, numbered from 0,
//! and an optional ROUTER socket that answers an 8-byte start sequence with every kept
//! batch from there (`[seq, payload]` each) and then the end marker (`seq` −1, empty
//! payload).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use pdserve_protocol::kv_events::{encode, KvCacheEvent, KvEventBatch, END_OF_REPLAY};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{to_events, CacheNews, EventSink, KvEventsConfig};

/// The messages a ZeroMQ PUB socket of this implementation queues per subscriber.
const PUB_QUEUE: usize = 100_000;

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
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Publisher {
    /// Opens the sockets and starts publishing what the returned sink receives.
    pub async fn start(config: KvEventsConfig) -> Result<Self, PublisherError> {
        let socket_error = |endpoint: &str| {
            let endpoint = endpoint.to_string();
            move |source| PublisherError::Socket { endpoint, source }
        };
        let mut publisher = PubSocket::new();
        let endpoint = if config.binds() {
            publisher
                .bind(&config.endpoint)
                .await
                .map_err(socket_error(&config.endpoint))?
                .to_string()
        } else {
            publisher
                .connect(&config.endpoint)
                .await
                .map_err(socket_error(&config.endpoint))?;
            config.endpoint.clone()
        };
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            Some(wanted) => {
                let mut router = RouterSocket::new();
                let bound = router.bind(wanted).await.map_err(socket_error(wanted))?;
                (Some(router), Some(bound.to_string()))
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
            topic: Bytes::from(config.topic.clone().into_bytes()),
            kept: VecDeque::new(),
            keep: config.buffer_steps,
            next_seq: 0,
            dropped,
        };
        tracing::info!(
            %endpoint,
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
        })
    }

    /// The queue the scheduler sends its changes into.
    pub fn sink(&self) -> EventSink {
        self.sink.clone()
    }
}

struct Sockets {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
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
        loop {
            tokio::select! {
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

    #[tokio::test]
    async fn batches_are_numbered_published_and_replayed() {
        let publisher = Publisher::start(KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
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
            let message = tokio::time::timeout(Duration::from_secs(5), sub.recv())
                .await
                .expect("a batch within 5 s")
                .unwrap()
                .into_vec();
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
}
