//! Reads whose blocks are still being computed when the read is accepted: the server
//! sends `ReadAccepted` and each block as it comes (the wire format of version 1,
//! only the timing differs), a wait for a block is not bounded by the frame timeout,
//! and a source that fails or a reader that hangs up ends the read exactly once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdserve_kv_transfer::frame::{read_frame, write_frame, FrameKind};
use pdserve_kv_transfer::{
    pull, server, BlockSource, ErrorCode, Export, NextBlock, Pending, PendingBlocks, PullConfig,
    ReadAccepted, ReadOutcome, ReadRequest, ReusedTokens, ServerConfig, TransferError,
    TransferStats,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const BLOCK: usize = 64;
const LAYOUT: &str = "test;f16;block=4";
/// The server's frame timeout in these tests; blocks take longer than this to come.
const FRAME_TIMEOUT: Duration = Duration::from_millis(300);

type Produced = Result<Vec<u8>, (ErrorCode, String)>;

/// Pending blocks the test produces by hand.
struct Produce(mpsc::UnboundedReceiver<Produced>);

impl PendingBlocks for Produce {
    fn next_block(&mut self) -> NextBlock<'_> {
        Box::pin(async move {
            (self.0.recv().await).unwrap_or_else(|| Err((ErrorCode::Internal, "gone".into())))
        })
    }
}

/// One read of `ready` blocks now and `pending` more that the test produces.
struct StreamingSource {
    ready: usize,
    pending: usize,
    produce: Mutex<Option<mpsc::UnboundedReceiver<Produced>>>,
    finished: Mutex<Vec<(ReadOutcome, TransferStats)>>,
}

impl BlockSource for StreamingSource {
    fn engine_id(&self) -> &str {
        "engine-a"
    }
    fn layout(&self) -> &str {
        LAYOUT
    }
    fn block_bytes(&self) -> usize {
        BLOCK
    }
    async fn export(&self, _: &ReadRequest) -> Result<Export, (ErrorCode, String)> {
        let Some(rx) = self.produce.lock().unwrap().take() else {
            return Err((ErrorCode::UnknownRequest, "read already".into()));
        };
        let total = self.ready + self.pending;
        Ok(Export {
            pending: Some(Pending {
                count: self.pending,
                blocks: Box::new(Produce(rx)),
            }),
            ..Export::ready(total * 4, blocks(0..self.ready), ReusedTokens::default())
        })
    }
    fn finish(&self, _: &str, outcome: ReadOutcome, stats: TransferStats) {
        self.finished.lock().unwrap().push((outcome, stats));
    }
}

fn blocks(range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range.map(|i| vec![i as u8 + 1; BLOCK]).collect()
}

/// A source of `ready` + `pending` blocks, its server's address, and the sender that
/// produces the pending blocks.
async fn start(
    ready: usize,
    pending: usize,
) -> (
    Arc<StreamingSource>,
    String,
    mpsc::UnboundedSender<Produced>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let source = Arc::new(StreamingSource {
        ready,
        pending,
        produce: Mutex::new(Some(rx)),
        finished: Mutex::default(),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = ServerConfig {
        io_timeout: FRAME_TIMEOUT,
        ..ServerConfig::default()
    };
    tokio::spawn(server::serve(
        listener,
        source.clone(),
        config,
        std::future::pending(),
    ));
    (source, addr, tx)
}

fn request(blocks: usize) -> ReadRequest {
    ReadRequest {
        engine_id: "engine-a".into(),
        request_id: "r".into(),
        block_ids: vec![u64::MAX; blocks],
        token_ids: (0..(blocks * 4) as u32).collect(),
        layout: LAYOUT.into(),
        traceparent: None,
        tracestate: None,
    }
}

/// Connects and sends the read request, as `pull` does.
async fn raw_read(addr: &str, blocks: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let json = serde_json::to_vec(&request(blocks)).unwrap();
    write_frame(&mut s, FrameKind::ReadRequest, &[&json])
        .await
        .unwrap();
    s
}

/// The next frame, which must come within a second.
async fn frame(s: &mut TcpStream) -> pdserve_kv_transfer::frame::Frame {
    tokio::time::timeout(Duration::from_secs(1), read_frame(s, 1 << 20))
        .await
        .expect("a frame in time")
        .unwrap()
}

/// Whether a byte arrives on `s` within `wait` (nothing is consumed).
async fn anything_within(s: &TcpStream, wait: Duration) -> bool {
    // `peek`, not `readable`: readiness left over from the last frame is not data.
    let mut byte = [0u8; 1];
    tokio::time::timeout(wait, s.peek(&mut byte)).await.is_ok()
}

async fn finished(source: &StreamingSource) -> (ReadOutcome, TransferStats) {
    tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            if let Some(f) = source.finished.lock().unwrap().first() {
                return f.clone();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the read is finished")
}

#[tokio::test]
async fn blocks_go_out_as_they_are_computed_however_long_each_takes() {
    let (source, addr, produce) = start(1, 2).await;
    let mut s = raw_read(&addr, 3).await;
    // Accepted at once, announcing every block, and the ready one follows.
    let accepted = frame(&mut s).await;
    assert_eq!(accepted.kind, FrameKind::ReadAccepted);
    let accepted: ReadAccepted = serde_json::from_slice(&accepted.payload).unwrap();
    assert_eq!((accepted.num_blocks, accepted.matched_tokens), (3, 12));
    let first = frame(&mut s).await;
    assert_eq!(
        (first.kind, &first.payload[..4]),
        (FrameKind::Block, &[0u8, 0, 0, 0][..])
    );
    // Nothing more until the next block exists, however long past the frame timeout.
    assert!(!anything_within(&s, FRAME_TIMEOUT * 2).await);
    produce.send(Ok(blocks(1..2).remove(0))).unwrap();
    let second = frame(&mut s).await;
    assert_eq!(second.payload[..4], 1u32.to_le_bytes());
    assert_eq!(second.payload[4..], blocks(1..2)[0][..]);
    assert!(!anything_within(&s, FRAME_TIMEOUT * 2).await);
    produce.send(Ok(blocks(2..3).remove(0))).unwrap();
    assert_eq!(frame(&mut s).await.payload[..4], 2u32.to_le_bytes());
    write_frame(&mut s, FrameKind::ReadComplete, &[])
        .await
        .unwrap();
    let (outcome, stats) = finished(&source).await;
    assert_eq!(outcome, ReadOutcome::Completed);
    assert_eq!((stats.blocks, stats.bytes), (3, 3 * BLOCK));
}

#[tokio::test]
async fn the_client_reads_a_streamed_export_like_any_other() {
    let (source, addr, produce) = start(0, 2).await;
    let config = PullConfig {
        io_timeout: Duration::from_secs(2),
        ..PullConfig::default()
    };
    let read = tokio::spawn(async move { pull(&addr, &request(2), BLOCK, &config).await });
    for block in blocks(0..2) {
        tokio::time::sleep(FRAME_TIMEOUT * 2).await;
        produce.send(Ok(block)).unwrap();
    }
    let pulled = read.await.unwrap().unwrap();
    assert_eq!(pulled.blocks, blocks(0..2));
    assert!(pulled.received_at.elapsed() < Duration::from_secs(1));
    assert_eq!(finished(&source).await.0, ReadOutcome::Completed);
}

#[tokio::test]
async fn a_block_that_will_not_come_ends_the_read_with_the_sources_error() {
    let (source, addr, produce) = start(1, 2).await;
    let read = {
        let addr = addr.clone();
        tokio::spawn(async move { pull(&addr, &request(3), BLOCK, &PullConfig::default()).await })
    };
    // Longer than a block frame: an error frame is not held to the block size.
    let why = "the prefill was cancelled before this block was computed, so it never comes";
    produce
        .send(Err((ErrorCode::UnknownRequest, why.into())))
        .unwrap();
    match read.await.unwrap() {
        Err(TransferError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::UnknownRequest);
            assert!(message.contains("cancelled"), "{message}");
        }
        other => panic!("expected the source's error, got {other:?}"),
    }
    assert!(matches!(finished(&source).await.0, ReadOutcome::Failed(_)));

    // A block of the wrong size is the source's bug: an internal error, not garbage.
    let (source, addr, produce) = start(0, 1).await;
    produce.send(Ok(vec![0; BLOCK - 1])).unwrap();
    let err = pull(&addr, &request(1), BLOCK, &PullConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::Internal,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(finished(&source).await.0, ReadOutcome::Failed(_)));
}

#[tokio::test]
async fn a_reader_that_hangs_up_while_a_block_is_computed_ends_the_read_at_once() {
    let (source, addr, _produce) = start(1, 2).await;
    let mut s = raw_read(&addr, 3).await;
    assert_eq!(frame(&mut s).await.kind, FrameKind::ReadAccepted);
    assert_eq!(frame(&mut s).await.kind, FrameKind::Block);
    drop(s);
    // Ended long before any frame timeout could fire (no block ever comes).
    let (outcome, stats) = finished(&source).await;
    assert!(
        matches!(outcome, ReadOutcome::Failed(ref why) if why.contains("hung up")),
        "{outcome:?}"
    );
    assert!(stats.elapsed < Duration::from_secs(2));
    assert_eq!(source.finished.lock().unwrap().len(), 1);
}
