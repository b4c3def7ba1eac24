//! Real-socket tests of the KV transfer protocol: happy path, refusals, garbage,
//! silent and dead peers, and that every accepted read is finished exactly once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdserve_kv_transfer::{
    pull, server, BlockSource, ErrorCode, Export, PeerAllowList, PullConfig, ReadOutcome,
    ReadRequest, ReusedTokens, ServerConfig, TransferError, TransferSecret, TransferStats,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const BLOCK: usize = 64;
const LAYOUT: &str = "test;f16;block=4";

struct Pinned {
    block_ids: Vec<u64>,
    tokens: Vec<u32>,
    blocks: Vec<Vec<u8>>,
    reused: ReusedTokens,
}

/// What every pinned entry says its publisher reused: one block's worth from each source.
const REUSED: ReusedTokens = ReusedTokens {
    prefix_cache_tokens: 4,
    earlier_turn_tokens: 4,
};

#[derive(Default)]
struct MemorySource {
    pinned: Mutex<HashMap<String, Pinned>>,
    finished: Mutex<Vec<(String, ReadOutcome, TransferStats)>>,
}

impl BlockSource for MemorySource {
    fn engine_id(&self) -> &str {
        "engine-a"
    }
    fn layout(&self) -> &str {
        LAYOUT
    }
    fn block_bytes(&self) -> usize {
        BLOCK
    }
    async fn export(&self, request: &ReadRequest) -> Result<Export, (ErrorCode, String)> {
        let pinned = self.pinned.lock().unwrap();
        let Some(p) = pinned.get(&request.request_id) else {
            return Err((ErrorCode::UnknownRequest, "nothing pinned".into()));
        };
        if p.block_ids != request.block_ids {
            return Err((ErrorCode::BlockMismatch, "other blocks".into()));
        }
        let matched = p
            .tokens
            .iter()
            .zip(&request.token_ids)
            .take_while(|(a, b)| a == b)
            .count();
        Ok(Export::ready(matched, p.blocks.clone(), p.reused))
    }
    fn finish(&self, request_id: &str, outcome: ReadOutcome, stats: TransferStats) {
        self.pinned.lock().unwrap().remove(request_id);
        self.finished
            .lock()
            .unwrap()
            .push((request_id.to_string(), outcome, stats));
    }
}

fn pin(source: &MemorySource, id: &str, n: usize) -> Vec<Vec<u8>> {
    let blocks: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8 + 1; BLOCK]).collect();
    source.pinned.lock().unwrap().insert(
        id.to_string(),
        Pinned {
            block_ids: (10..10 + n as u64).collect(),
            tokens: (0..(n * 4) as u32).collect(),
            blocks: blocks.clone(),
            reused: REUSED,
        },
    );
    blocks
}

fn request(id: &str, n: usize) -> ReadRequest {
    ReadRequest {
        engine_id: "engine-a".into(),
        request_id: id.into(),
        block_ids: (10..10 + n as u64).collect(),
        token_ids: (0..(n * 4) as u32).collect(),
        layout: LAYOUT.into(),
        traceparent: None,
        tracestate: None,
    }
}

fn quick() -> PullConfig {
    PullConfig {
        connect_timeout: Duration::from_millis(500),
        io_timeout: Duration::from_millis(500),
        secret: None,
    }
}

async fn start(source: Arc<MemorySource>) -> (String, tokio::sync::oneshot::Sender<()>) {
    start_with(source, ServerConfig::default()).await
}

async fn start_with(
    source: Arc<MemorySource>,
    config: ServerConfig,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let config = ServerConfig {
        io_timeout: Duration::from_millis(500),
        ..config
    };
    tokio::spawn(server::serve(listener, source, config, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

#[tokio::test]
async fn pulls_pinned_blocks_and_releases_them() {
    let source = Arc::new(MemorySource::default());
    let blocks = pin(&source, "r1", 3);
    let (addr, _stop) = start(source.clone()).await;
    let got = pull(&addr, &request("r1", 3), BLOCK, &quick())
        .await
        .unwrap();
    assert_eq!(got.blocks, blocks);
    assert_eq!(got.matched_tokens, 12);
    assert_eq!(
        got.reused, REUSED,
        "the publisher's reused tokens travel with the blocks"
    );
    assert_eq!(got.bytes, 3 * BLOCK);
    // The server finishes after the client's confirmation arrives.
    tokio::time::timeout(Duration::from_secs(2), async {
        while source.finished.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    {
        let finished = source.finished.lock().unwrap();
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0].1, ReadOutcome::Completed);
        assert_eq!(finished[0].2.blocks, 3);
        assert!(source.pinned.lock().unwrap().is_empty());
    }
    // A second read of the same request is refused: the blocks are gone.
    let err = pull(&addr, &request("r1", 3), BLOCK, &quick())
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        TransferError::Remote {
            code: ErrorCode::UnknownRequest,
            ..
        }
    ));
}

#[tokio::test]
async fn refusals_name_the_problem() {
    let source = Arc::new(MemorySource::default());
    pin(&source, "r1", 2);
    let (addr, _stop) = start(source.clone()).await;

    let mut wrong_engine = request("r1", 2);
    wrong_engine.engine_id = "engine-b".into();
    let mut wrong_layout = request("r1", 2);
    wrong_layout.layout = "other".into();
    let mut wrong_blocks = request("r1", 2);
    wrong_blocks.block_ids = vec![1, 2];
    for (req, want) in [
        (wrong_engine, ErrorCode::WrongEngine),
        (wrong_layout, ErrorCode::LayoutMismatch),
        (wrong_blocks, ErrorCode::BlockMismatch),
        (request("nope", 2), ErrorCode::UnknownRequest),
    ] {
        match pull(&addr, &req, BLOCK, &quick()).await {
            Err(TransferError::Remote { code, .. }) => assert_eq!(code, want),
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
    // A client expecting another block size refuses what it is sent.
    let err = pull(&addr, &request("r1", 2), BLOCK * 2, &quick())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("expected 128"), "{err}");
    // Refused reads never count as finished; the wrong-size read was accepted and failed.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let finished = source.finished.lock().unwrap();
    assert_eq!(finished.len(), 1);
    assert!(matches!(finished[0].1, ReadOutcome::Failed(_)));
}

#[tokio::test]
async fn token_mismatch_is_reported_not_hidden() {
    let source = Arc::new(MemorySource::default());
    pin(&source, "r1", 2);
    let (addr, _stop) = start(source).await;
    let mut req = request("r1", 2);
    req.token_ids[5] = 999;
    let got = pull(&addr, &req, BLOCK, &quick()).await.unwrap();
    assert_eq!(got.matched_tokens, 5);
    // Reused counts never exceed what matched.
    assert_eq!(
        got.reused,
        ReusedTokens {
            prefix_cache_tokens: 4,
            earlier_turn_tokens: 1
        }
    );
}

#[tokio::test]
async fn server_survives_garbage_and_truncation() {
    let source = Arc::new(MemorySource::default());
    let blocks = pin(&source, "r1", 1);
    let (addr, _stop) = start(source.clone()).await;
    // HTTP instead of frames.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf)).await;
    // A header promising a huge frame, then nothing.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut header = b"PDKV\x01\x01\x00\x00".to_vec();
    header.extend_from_slice(&u32::MAX.to_le_bytes());
    s.write_all(&header).await.unwrap();
    // A truncated frame, then close.
    let mut s2 = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s2.write_all(b"PDKV\x01\x01\x00\x00\x10\x00\x00\x00{\"a\"")
        .await
        .unwrap();
    drop(s2);
    // The server still serves a real read.
    let got = pull(&addr, &request("r1", 1), BLOCK, &quick())
        .await
        .unwrap();
    assert_eq!(got.blocks, blocks);
}

#[tokio::test]
async fn client_that_vanishes_mid_read_fails_the_read() {
    let source = Arc::new(MemorySource::default());
    pin(&source, "r1", 2);
    let (addr, _stop) = start(source.clone()).await;
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let json = serde_json::to_vec(&request("r1", 2)).unwrap();
    pdserve_kv_transfer::frame::write_frame(
        &mut s,
        pdserve_kv_transfer::frame::FrameKind::ReadRequest,
        &[&json],
    )
    .await
    .unwrap();
    let mut first = [0u8; 12];
    s.read_exact(&mut first).await.unwrap();
    drop(s);
    tokio::time::timeout(Duration::from_secs(3), async {
        while source.finished.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the broken read is finished");
    let finished = source.finished.lock().unwrap();
    assert!(matches!(finished[0].1, ReadOutcome::Failed(_)));
    assert!(source.pinned.lock().unwrap().is_empty());
}

#[tokio::test]
async fn dead_silent_and_garbage_peers_fail_in_bounded_time() {
    let started = std::time::Instant::now();
    // Dead: nothing listens.
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let err = pull(&dead_addr, &request("r", 1), BLOCK, &quick())
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::Connect { .. }), "{err}");

    // Silent: accepts, never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let hold = tokio::spawn(async move {
        let (s, _) = silent.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(s);
    });
    let err = pull(&silent_addr, &request("r", 1), BLOCK, &quick())
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_)), "{err}");
    hold.abort();

    // Garbage: answers HTTP.
    let garbage = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let garbage_addr = garbage.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = garbage.accept().await.unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
    });
    let err = pull(&garbage_addr, &request("r", 1), BLOCK, &quick())
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::Protocol(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

fn refusal(err: TransferError) -> ErrorCode {
    match err {
        TransferError::Remote { code, .. } => code,
        other => panic!("expected a refusal, got {other}"),
    }
}

/// With a secret configured, a read without it or with another one is refused before
/// anything is looked up (the blocks stay pinned); the right secret reads them.
#[tokio::test]
async fn reads_need_the_shared_secret() {
    let source = Arc::new(MemorySource::default());
    let blocks = pin(&source, "r1", 2);
    let config = ServerConfig {
        secret: TransferSecret::new("correct horse"),
        ..ServerConfig::default()
    };
    let (addr, _stop) = start_with(source.clone(), config).await;
    for offered in [None, TransferSecret::new("wrong horse")] {
        let config = PullConfig {
            secret: offered,
            ..quick()
        };
        let err = pull(&addr, &request("r1", 2), BLOCK, &config)
            .await
            .unwrap_err();
        assert_eq!(refusal(err), ErrorCode::Unauthorized);
        assert!(source.pinned.lock().unwrap().contains_key("r1"));
    }
    let config = PullConfig {
        secret: TransferSecret::new("correct horse"),
        ..quick()
    };
    let got = pull(&addr, &request("r1", 2), BLOCK, &config)
        .await
        .unwrap();
    assert_eq!(got.blocks, blocks);
    let started = std::time::Instant::now();
    while !source.pinned.lock().unwrap().is_empty() {
        assert!(started.elapsed() < Duration::from_secs(5), "never freed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A connection from an address outside `--kv-peers` is refused whatever it asks.
#[tokio::test]
async fn connections_from_peers_not_allowed_are_refused() {
    let source = Arc::new(MemorySource::default());
    pin(&source, "r1", 1);
    let mut only_v6 = PeerAllowList::default();
    only_v6.add("::1").unwrap();
    let config = ServerConfig {
        peers: Some(Arc::new(only_v6)),
        ..ServerConfig::default()
    };
    let (addr, _stop) = start_with(source.clone(), config).await;
    let err = pull(&addr, &request("r1", 1), BLOCK, &quick())
        .await
        .unwrap_err();
    assert_eq!(refusal(err), ErrorCode::PeerNotAllowed);
    assert!(source.pinned.lock().unwrap().contains_key("r1"));
    assert!(source.finished.lock().unwrap().is_empty());
}
