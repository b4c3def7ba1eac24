//! The gateway's KV-event subscriber against a publisher the test drives: events fill
//! the worker's index; garbage frames, unknown tags, gaps (filled by replay or not), a
//! publisher restart and a changed block size are counted and handled without a crash;
//! the index stays under its cap; a worker that leaves takes its index with it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdserve_protocol::kv_events::{encode, EngineBlockHash, KvCacheEvent, KvEventBatch};
use serde_json::json;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::double::{Double, Role};
use crate::{bounded, client, metric, pd_config, Gateway};

/// Batches kept for replay, as `(seq, payload)`.
type Kept = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A publisher whose every message the test writes, with a replay socket that answers
/// from what the test put in `kept`.
pub struct FakePublisher {
    pub endpoint: String,
    socket: PubSocket,
    replay_endpoint: String,
    kept: Kept,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakePublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakePublisher {
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// With `topic_in_replay`, replay answers are vLLM 0.32's: `["", topic, seq, payload]`
    /// and the end marker `["", "", -1, ""]`.
    pub async fn start_with(topic_in_replay: bool) -> Self {
        let mut socket = PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut router = RouterSocket::new();
        let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let kept: Kept = Arc::default();
        let from_kept = kept.clone();
        let task = tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
                let batches: Vec<_> = from_kept.lock().unwrap().clone();
                for (seq, payload) in batches.into_iter().filter(|(s, _)| *s >= start) {
                    let mut reply = ZmqMessage::from(frames[0].clone());
                    reply.push_back(Bytes::new());
                    if topic_in_replay {
                        reply.push_back(Bytes::from_static(b"kv"));
                    }
                    reply.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                    reply.push_back(Bytes::from(payload));
                    router.send(reply).await.unwrap();
                }
                let mut end = ZmqMessage::from(frames[0].clone());
                end.push_back(Bytes::new());
                if topic_in_replay {
                    end.push_back(Bytes::new());
                }
                end.push_back(Bytes::copy_from_slice(&(-1i64).to_be_bytes()));
                end.push_back(Bytes::new());
                router.send(end).await.unwrap();
            }
        });
        Self {
            socket,
            endpoint,
            replay_endpoint,
            kept,
            task,
        }
    }

    async fn send_frames(&mut self, frames: Vec<Bytes>) {
        let mut message = ZmqMessage::from(frames[0].clone());
        for frame in &frames[1..] {
            message.push_back(frame.clone());
        }
        self.socket.send(message).await.unwrap();
    }

    /// Publishes `events` as batch `seq` (and keeps it for replay).
    pub async fn publish(&mut self, seq: u64, events: Vec<KvCacheEvent>) {
        let payload = batch(events);
        self.kept.lock().unwrap().push((seq, payload.clone()));
        self.send_frames(vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .await;
    }

    /// Publishes clears until the gateway has counted one (a PUB socket drops what it
    /// sends before a subscriber is connected); returns the next sequence number.
    pub async fn until_heard(&mut self, gw: &Gateway) -> u64 {
        for seq in 0..200 {
            self.publish(seq, vec![KvCacheEvent::AllBlocksCleared])
                .await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if metric(gw, "pdserve_gateway_kv_events_total").await > 0.0 {
                return seq + 1;
            }
        }
        panic!("the gateway never subscribed");
    }

    /// Keeps `events` as batch `seq` for replay without publishing it (a lost message).
    fn lose(&self, seq: u64, events: Vec<KvCacheEvent>) {
        self.kept.lock().unwrap().push((seq, batch(events)));
    }
}

fn batch(events: Vec<KvCacheEvent>) -> Vec<u8> {
    encode(&KvEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    })
}

/// `n` blocks of `block_size` tokens chained from the start, hashed `first..first+n`.
pub fn stored(first: u64, n: u64, block_size: u32) -> KvCacheEvent {
    KvCacheEvent::BlockStored {
        block_hashes: (first..first + n).map(EngineBlockHash::Int).collect(),
        parent_block_hash: None,
        token_ids: (0..(n as u32) * block_size)
            .map(|t| t + first as u32 * 1000)
            .collect(),
        block_size,
        lora_id: None,
        medium: None,
        lora_name: None,
    }
}

pub async fn wait_metric(gw: &Gateway, name: &str, wanted: f64) {
    for _ in 0..500 {
        if metric(gw, name).await == wanted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{name} = {}, wanted {wanted}", metric(gw, name).await);
}

#[tokio::test]
async fn the_index_follows_events_and_survives_garbage_gaps_restarts_and_size_changes() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut publisher = FakePublisher::start().await;
        let mut config = pd_config(&[&p], &[&d]);
        config
            .kv_events
            .publishers
            .insert(p.url.clone(), publisher.endpoint.clone());
        config
            .kv_events
            .replays
            .insert(p.url.clone(), publisher.replay_endpoint.clone());
        let gw = Gateway::start(config).await;
        let blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, p.url);
        let rebuilds = |reason: &str| {
            format!(
                r#"pdserve_gateway_kv_index_rebuilds_total{{worker="{}",reason="{reason}"}}"#,
                p.url
            )
        };

        let mut seq = publisher.until_heard(&gw).await;
        // What was published before the subscription came was replayed (joined
        // mid-stream), so nothing here is a gap.
        publisher.publish(seq, vec![stored(1, 3, 4)]).await;
        seq += 1;
        wait_metric(&gw, &blocks, 3.0).await;

        // Garbage: wrong frame counts, a short sequence number, undecodable payloads,
        // an unknown event tag. None of it changes the index or stops the stream.
        publisher.send_frames(vec![Bytes::from_static(b"kv")]).await;
        publisher
            .send_frames(vec![
                Bytes::from_static(b"kv"),
                Bytes::from_static(b"\x01"),
                Bytes::from(batch(vec![])),
            ])
            .await;
        let unknown = rmpv::Value::Map(vec![
            ("ts".into(), rmpv::Value::F64(0.0)),
            (
                "events".into(),
                rmpv::Value::Array(vec![rmpv::Value::Map(vec![(
                    "type".into(),
                    "BlockPinned".into(),
                )])]),
            ),
        ]);
        let mut unknown_bytes = Vec::new();
        rmpv::encode::write_value(&mut unknown_bytes, &unknown).unwrap();
        for payload in [
            Bytes::from_static(b"\xc1garbage"),
            Bytes::from(unknown_bytes),
        ] {
            publisher
                .send_frames(vec![
                    Bytes::from_static(b"kv"),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ])
                .await;
            seq += 1;
        }
        publisher.publish(seq, vec![stored(10, 1, 4)]).await;
        seq += 1;
        wait_metric(&gw, &blocks, 4.0).await;
        assert!(metric(&gw, "pdserve_gateway_kv_event_errors_total").await >= 3.0);
        assert_eq!(
            metric(
                &gw,
                &format!(
                    r#"pdserve_gateway_kv_events_total{{worker="{}",kind="skipped"}}"#,
                    p.url
                )
            )
            .await,
            1.0
        );

        // A lost batch is filled by replay: its blocks arrive, nothing is rebuilt.
        let filled = format!(
            r#"pdserve_gateway_kv_event_replays_total{{worker="{}",outcome="filled"}}"#,
            p.url
        );
        let filled_before = metric(&gw, &filled).await;
        publisher.lose(seq, vec![stored(20, 2, 4)]);
        publisher.publish(seq + 1, vec![stored(30, 1, 4)]).await;
        seq += 2;
        wait_metric(&gw, &blocks, 7.0).await;
        assert_eq!(metric(&gw, &filled).await, filled_before + 1.0);
        assert_eq!(metric(&gw, &rebuilds("gap")).await, 0.0);

        // A gap the replay cannot fill (the batch is gone from its buffer too): the
        // index starts over from the batch that revealed the gap.
        seq += 1;
        publisher.publish(seq, vec![stored(40, 2, 4)]).await;
        wait_metric(&gw, &rebuilds("gap"), 1.0).await;
        wait_metric(&gw, &blocks, 2.0).await;

        // The publisher restarts: its sequence goes back to 0.
        publisher.kept.lock().unwrap().clear();
        publisher
            .publish(0, vec![KvCacheEvent::AllBlocksCleared, stored(50, 1, 4)])
            .await;
        wait_metric(&gw, &rebuilds("restart"), 1.0).await;
        wait_metric(&gw, &blocks, 1.0).await;

        // Another engine behind the URL, with another block size.
        publisher.publish(1, vec![stored(60, 3, 8)]).await;
        wait_metric(&gw, &rebuilds("block_size"), 1.0).await;
        wait_metric(&gw, &blocks, 3.0).await;
        // The gateway served all along.
        assert_eq!(gw.chat_status().await, 200);
    })
    .await;
}

#[tokio::test]
async fn a_million_blocks_stay_under_the_cap_and_a_removed_worker_takes_its_index() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut publisher = FakePublisher::start().await;
        let mut config = pd_config(&[], &[&d]);
        config.kv_events.max_indexed_blocks = std::num::NonZeroUsize::new(10_000).unwrap();
        config.admin_api_key = Some("admin".into());
        let gw = Gateway::start(config).await;
        // Registered with its event endpoint, as a launcher or discovery would.
        let registered = client()
            .post(gw.at("/instances"))
            .header("x-api-key", "admin")
            .json(
                &json!({"role": "prefill", "url": p.url, "kv_events_endpoint": publisher.endpoint}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(registered.status(), 200);
        let blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, p.url);
        let mut seq = publisher.until_heard(&gw).await;
        // 1M distinct one-token blocks, 10k per batch.
        for chunk in 0..100u64 {
            publisher
                .publish(seq, vec![stored(chunk * 10_000, 10_000, 1)])
                .await;
            seq += 1;
        }
        wait_metric(
            &gw,
            &format!(
                r#"pdserve_gateway_kv_events_total{{worker="{}",kind="block_stored"}}"#,
                p.url
            ),
            100.0,
        )
        .await;
        assert_eq!(metric(&gw, &blocks).await, 10_000.0);

        let removed = client()
            .delete(gw.at(&format!("/instances?url={}", p.url)))
            .header("x-api-key", "admin")
            .send()
            .await
            .unwrap();
        assert_eq!(removed.status(), 200);
        for _ in 0..200 {
            let text = client()
                .get(gw.at("/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if !text.contains(&blocks) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the removed worker's index is still exported");
    })
    .await;
}

/// A publisher that connects to the gateway's collector, as vLLM's does when its endpoint
/// is concrete, and sends under `topic`.
struct ConnectingPublisher {
    socket: PubSocket,
    topic: Bytes,
}

impl ConnectingPublisher {
    async fn connect(collector: &str, topic: &str) -> Self {
        let mut socket = PubSocket::new();
        socket.connect(collector).await.unwrap();
        Self {
            socket,
            topic: Bytes::from(topic.to_string()),
        }
    }

    async fn publish(&mut self, seq: u64, events: Vec<KvCacheEvent>) {
        let mut message = ZmqMessage::from(self.topic.clone());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(Bytes::from(batch(events)));
        self.socket.send(message).await.unwrap();
    }
}

/// A loopback port nothing listens on (for the collector to bind).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `kv@HOST:PORT@MODEL` for a worker URL `http://HOST:PORT`.
fn topic_of(url: &str) -> String {
    format!("kv@{}@m", url.trim_start_matches("http://"))
}

#[tokio::test]
async fn a_bound_collector_attributes_events_by_topic_and_counts_unknown_ones() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let collector = format!("tcp://127.0.0.1:{}", free_port());
        let mut config = pd_config(&[&p], &[&d]);
        config.kv_events.bind = Some(collector.clone());
        config.admin_api_key = Some("admin".into());
        let gw = Gateway::start(config).await;
        let total = |url: &str, kind: &str| {
            format!(r#"pdserve_gateway_kv_events_total{{worker="{url}",kind="{kind}"}}"#)
        };
        let blocks = |url: &str| format!(r#"pdserve_gateway_kv_index_blocks{{worker="{url}"}}"#);
        let unknown = "pdserve_gateway_kv_events_unknown_topic_total";

        let mut from_p = ConnectingPublisher::connect(&collector, &topic_of(&p.url)).await;
        let mut from_d = ConnectingPublisher::connect(&collector, &topic_of(&d.url)).await;
        let mut stranger = ConnectingPublisher::connect(&collector, "kv@127.0.0.1:1@m").await;
        let mut untagged = ConnectingPublisher::connect(&collector, "").await;
        // Until the collector's subscription reached every publisher.
        let mut seq = 0;
        loop {
            for publisher in [&mut from_p, &mut from_d] {
                publisher
                    .publish(seq, vec![KvCacheEvent::AllBlocksCleared])
                    .await;
            }
            seq += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if metric(&gw, &total(&p.url, "all_blocks_cleared")).await > 0.0
                && metric(&gw, &total(&d.url, "all_blocks_cleared")).await > 0.0
            {
                break;
            }
            assert!(seq < 200, "the collector never heard both workers");
        }
        // Each worker's blocks land in its own index.
        from_p.publish(seq, vec![stored(1, 3, 16)]).await;
        from_d.publish(seq, vec![stored(100, 5, 16)]).await;
        seq += 1;
        wait_metric(&gw, &blocks(&p.url), 3.0).await;
        wait_metric(&gw, &blocks(&d.url), 5.0).await;

        // Topics naming no registered worker are counted and dropped.
        let before = metric(&gw, unknown).await;
        for n in 0..200u64 {
            stranger.publish(n, vec![stored(500, 2, 16)]).await;
            untagged.publish(n, vec![stored(600, 2, 16)]).await;
            if metric(&gw, unknown).await >= before + 2.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(metric(&gw, unknown).await >= before + 2.0);
        assert_eq!(metric(&gw, &blocks(&p.url)).await, 3.0);
        assert_eq!(metric(&gw, &blocks(&d.url)).await, 5.0);

        // A gap with no replay endpoint: that worker's index starts over; the other's
        // stays.
        from_p.publish(seq + 5, vec![stored(200, 1, 16)]).await;
        wait_metric(
            &gw,
            &format!(
                r#"pdserve_gateway_kv_index_rebuilds_total{{worker="{}",reason="gap"}}"#,
                p.url
            ),
            1.0,
        )
        .await;
        wait_metric(&gw, &blocks(&p.url), 1.0).await;
        assert_eq!(metric(&gw, &blocks(&d.url)).await, 5.0);

        // A worker that leaves takes its collected index with it; its events are then
        // from an unknown topic.
        let removed = client()
            .delete(gw.at(&format!("/instances?url={}", d.url)))
            .header("x-api-key", "admin")
            .send()
            .await
            .unwrap();
        assert_eq!(removed.status(), 200);
        for _ in 0..200 {
            let text = client().get(gw.at("/metrics")).send().await.unwrap();
            if !text.text().await.unwrap().contains(&blocks(&d.url)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = metric(&gw, unknown).await;
        from_d.publish(seq, vec![stored(300, 1, 16)]).await;
        wait_metric(&gw, unknown, before + 1.0).await;
        assert_eq!(metric(&gw, &blocks(&d.url)).await, 0.0);
    })
    .await;
}

#[tokio::test]
async fn a_collector_that_cannot_bind_stops_the_gateway_with_the_reason() {
    bounded(async {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://{}", taken.local_addr().unwrap());
        let d = Double::start(Role::Decode, "D").await;
        let mut config = pd_config(&[], &[&d]);
        config.kv_events.bind = Some(endpoint.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let err = pdserve_gateway::serve(listener, config, std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--kv-events-bind") && err.contains(&endpoint),
            "{err}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_gap_is_filled_from_a_vllm_0_32_replay_socket_that_sends_the_topic() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let mut publisher = FakePublisher::start_with(true).await;
        let mut config = pd_config(&[&p], &[&d]);
        config
            .kv_events
            .publishers
            .insert(p.url.clone(), publisher.endpoint.clone());
        config
            .kv_events
            .replays
            .insert(p.url.clone(), publisher.replay_endpoint.clone());
        let gw = Gateway::start(config).await;
        let blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, p.url);
        let seq = publisher.until_heard(&gw).await;
        // A batch lost on the way, then the next: the gap is replayed, not rebuilt.
        let filled = format!(
            r#"pdserve_gateway_kv_event_replays_total{{worker="{}",outcome="filled"}}"#,
            p.url
        );
        let before = metric(&gw, &filled).await;
        publisher.lose(seq, vec![stored(1, 3, 4)]);
        publisher.publish(seq + 1, vec![stored(10, 2, 4)]).await;
        // The lost batch's 3 blocks came from the replay.
        wait_metric(&gw, &blocks, 5.0).await;
        assert_eq!(metric(&gw, &filled).await, before + 1.0);
        assert_eq!(
            metric(&gw, "pdserve_gateway_kv_index_rebuilds_total").await,
            0.0
        );
    })
    .await;
}
