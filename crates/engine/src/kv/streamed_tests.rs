//! Streamed reads over a real scheduler (fake model, one chunk of 16 tokens per step,
//! slow steps) and real sockets: blocks leave while the prefill computes, and every way
//! a streamed read or its prefill can end leaves no block pinned.

use std::time::Duration;

use pdserve_kv_transfer::frame::{read_frame, write_frame, Frame, FrameKind};
use pdserve_kv_transfer::{
    pull, ErrorCode, PullConfig, ReadAccepted, ReadRequest, ServerConfig, TransferError,
};
use tokio::net::{TcpListener, TcpStream};

use super::awaited::{awaited_block_ids, ExpectedPublication};
use super::service_tests::finished_feeding;
use super::*;
use crate::request::{GenerationRequest, SeqEvent, SeqEvents};
use crate::scheduler::{spawn, SchedulerConfig};
use crate::step_model::fake::FakeModel;

const DEADLINE: Duration = Duration::from_secs(20);
/// 6 full blocks and 4 tokens: 7 chunks of 16, one per step.
const PROMPT_TOKENS: u32 = 100;
const BLOCKS: usize = 7;

struct Rig {
    engine: EngineHandle,
    thread: Option<std::thread::JoinHandle<()>>,
    service: Arc<KvService>,
    metrics: Arc<Metrics>,
    addr: String,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.server.abort();
        self.engine.shutdown();
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

/// A prefill worker's scheduler (16-token chunks, 60 ms per step) and KV service.
async fn rig() -> Rig {
    rig_with(|service| service).await
}

/// [`rig`] whose KV service `configure` sets up.
async fn rig_with(configure: impl FnOnce(KvService) -> KvService) -> Rig {
    let metrics = Arc::new(Metrics::new());
    let config = SchedulerConfig {
        policy: crate::scheduler::SchedulingPolicy::Fcfs,
        max_num_seqs: 4,
        max_waiting: 8,
        max_num_batched_tokens: 16,
        max_model_len: 256,
    };
    let mut model = FakeModel::new(32);
    model.step_delay = Duration::from_millis(60);
    let (engine, thread) = spawn(model, config, metrics.clone()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let service = Arc::new(configure(KvService::new(
        KvServiceConfig {
            engine_id: "engine-p".into(),
            layout: "fake".into(),
            block_bytes: 64,
            host: "127.0.0.1".into(),
            port: listener.local_addr().unwrap().port(),
            abort_timeout: Duration::from_secs(2),
            conversation_budget: 4,
        },
        engine.clone(),
        metrics.clone(),
    )));
    let server = tokio::spawn(pdserve_kv_transfer::server::serve(
        listener,
        service.clone(),
        ServerConfig::default(),
        std::future::pending(),
    ));
    Rig {
        engine,
        thread: Some(thread),
        service,
        metrics,
        addr,
        server,
    }
}

fn prompt() -> Vec<u32> {
    (1..=PROMPT_TOKENS).collect()
}

/// What the fake model's block `index` of `prompt` holds (its tokens, unwritten slots
/// as `u32::MAX`).
fn fake_block(prompt: &[u32], index: usize) -> Vec<u8> {
    (index * 16..(index + 1) * 16)
        .flat_map(|p| prompt.get(p).copied().unwrap_or(u32::MAX).to_le_bytes())
        .collect()
}

fn awaited_read(id: &str, tokens: &[u32]) -> ReadRequest {
    ReadRequest {
        engine_id: "engine-p".into(),
        request_id: id.into(),
        block_ids: awaited_block_ids(tokens.len()),
        token_ids: tokens.to_vec(),
        layout: "fake".into(),
        traceparent: None,
        tracestate: None,
    }
}

/// Starts `read` frame by frame, as `pull` does.
async fn raw_read(addr: &str, read: &ReadRequest) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let json = serde_json::to_vec(read).unwrap();
    write_frame(&mut s, FrameKind::ReadRequest, &[&json])
        .await
        .unwrap();
    s
}

async fn frame(s: &mut TcpStream) -> Frame {
    tokio::time::timeout(DEADLINE, read_frame(s, 1 << 20))
        .await
        .expect("a frame in time")
        .unwrap()
}

/// The prefill of `prompt` feeding `expected`'s feed, as `prepare_prefill` submits it.
fn submit_prefill(engine: &EngineHandle, expected: &ExpectedPublication) -> SeqEvents {
    let mut req = GenerationRequest::new(prompt(), 1);
    req.pin_on_finish = true;
    req.kv_feed = Some(expected.feed().clone());
    engine.submit(req).unwrap()
}

/// Whether the sequence has finished by now (reading the events that came so far).
fn has_finished(events: &mut SeqEvents) -> bool {
    while let Ok(event) = events.try_recv() {
        if matches!(event, SeqEvent::Finished { .. } | SeqEvent::Failed(_)) {
            return true;
        }
    }
    false
}

/// Waits for the sequence's end and publishes its blocks under `expected`'s id, as the
/// prefill's `Generation` does, then drops the announcement.
async fn publish_when_done(
    service: &KvService,
    events: &mut SeqEvents,
    expected: ExpectedPublication,
) -> KvTransferParams {
    loop {
        match tokio::time::timeout(DEADLINE, events.recv()).await.unwrap() {
            Some(SeqEvent::Finished {
                pinned: Some(pinned),
                ..
            }) => {
                let id = Some(expected.id().to_string());
                let params = service
                    .publish_as(pinned, PublishKind::Prefill, id)
                    .unwrap();
                drop(expected);
                return params;
            }
            Some(SeqEvent::Finished { .. } | SeqEvent::Failed(_)) | None => panic!("no KV"),
            Some(_) => {}
        }
    }
}

/// Waits until nothing is pinned, in the pool and by the service's count, and no read
/// is in progress.
async fn settled(rig: &Rig) {
    let start = Instant::now();
    while rig.metrics.kv_blocks_pinned.get() != 0
        || rig.metrics.kv.pinned_blocks.get() != 0
        || rig.service.pending_exports() != 0
    {
        assert!(start.elapsed() < DEADLINE, "pins never settled at 0");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let st = rig.service.lock();
    assert!(st.spent.is_empty() && st.expected.is_empty() && st.reading.is_empty());
}

fn refused_as(err: &TransferError, want: ErrorCode) -> bool {
    matches!(err, TransferError::Remote { code, .. } if *code == want)
}

#[tokio::test]
async fn blocks_leave_while_the_prefill_computes_and_nothing_stays_pinned() {
    let rig = rig().await;
    let prompt = prompt();
    let expected = rig.service.expect("pdkv-s", &prompt).unwrap();
    let mut s = raw_read(&rig.addr, &awaited_read("pdkv-s", &prompt)).await;
    let mut events = submit_prefill(&rig.engine, &expected);
    let accepted = frame(&mut s).await;
    assert_eq!(accepted.kind, FrameKind::ReadAccepted);
    let accepted: ReadAccepted = serde_json::from_slice(&accepted.payload).unwrap();
    assert_eq!(
        (accepted.matched_tokens, accepted.num_blocks),
        (100, BLOCKS)
    );
    for index in 0..BLOCKS {
        let block = frame(&mut s).await;
        assert_eq!(block.kind, FrameKind::Block);
        assert_eq!(block.payload[..4], (index as u32).to_le_bytes());
        assert_eq!(
            block.payload[4..],
            fake_block(&prompt, index),
            "block {index}"
        );
        if index == 0 {
            // Six more chunks (one 60 ms step each) are still to compute.
            assert!(
                !has_finished(&mut events),
                "the first block came before the end"
            );
        }
    }
    write_frame(&mut s, FrameKind::ReadComplete, &[])
        .await
        .unwrap();
    let params = publish_when_done(&rig.service, &mut events, expected).await;
    assert_eq!(params.remote_request_id.as_deref(), Some("pdkv-s"));
    settled(&rig).await;
    assert!(rig.metrics.kv.blocks_streamed.get() >= 5);
    assert_eq!(rig.metrics.kv.serve_failures.get(), 0);

    // The same prompt again: its cached blocks go out at admission, the rest as computed.
    let expected = rig.service.expect("pdkv-t", &prompt).unwrap();
    let read = {
        let (addr, read) = (rig.addr.clone(), awaited_read("pdkv-t", &prompt));
        tokio::spawn(async move { pull(&addr, &read, 64, &PullConfig::default()).await })
    };
    let mut events = submit_prefill(&rig.engine, &expected);
    let pulled = tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        pulled.blocks,
        (0..BLOCKS)
            .map(|i| fake_block(&prompt, i))
            .collect::<Vec<_>>()
    );
    assert_eq!(pulled.reused.prefix_cache_tokens, 96);
    publish_when_done(&rig.service, &mut events, expected).await;
    settled(&rig).await;
}

#[tokio::test]
async fn a_reader_that_hangs_up_mid_stream_leaves_nothing_pinned() {
    let rig = rig().await;
    let prompt = prompt();
    let expected = rig.service.expect("pdkv-h", &prompt).unwrap();
    let mut s = raw_read(&rig.addr, &awaited_read("pdkv-h", &prompt)).await;
    let mut events = submit_prefill(&rig.engine, &expected);
    assert_eq!(frame(&mut s).await.kind, FrameKind::ReadAccepted);
    assert_eq!(frame(&mut s).await.kind, FrameKind::Block);
    drop(s);
    // Seen at once, not when the next block is computed.
    let start = Instant::now();
    while rig.metrics.kv.serve_failures.get() == 0 {
        assert!(start.elapsed() < DEADLINE, "the broken read never ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !has_finished(&mut events),
        "the read ended before the prefill"
    );
    // The prefill still publishes; nobody will read that, so it is freed on arrival.
    publish_when_done(&rig.service, &mut events, expected).await;
    settled(&rig).await;
    let err = pull(
        &rig.addr,
        &awaited_read("pdkv-h", &prompt),
        64,
        &PullConfig::default(),
    )
    .await
    .unwrap_err();
    assert!(refused_as(&err, ErrorCode::UnknownRequest), "{err}");
}

#[tokio::test]
async fn a_prefill_cancelled_mid_stream_fails_its_read_and_leaves_nothing_pinned() {
    let rig = rig().await;
    let prompt = prompt();
    let expected = rig.service.expect("pdkv-c", &prompt).unwrap();
    let mut s = raw_read(&rig.addr, &awaited_read("pdkv-c", &prompt)).await;
    let events = submit_prefill(&rig.engine, &expected);
    assert_eq!(frame(&mut s).await.kind, FrameKind::ReadAccepted);
    assert_eq!(frame(&mut s).await.kind, FrameKind::Block);
    // The prefill's client leaves: its output and its announcement go.
    drop(events);
    drop(expected);
    let error = frame(&mut s).await;
    assert_eq!(error.kind, FrameKind::Error, "instead of the next block");
    let message: pdserve_kv_transfer::message::ErrorMessage =
        serde_json::from_slice(&error.payload).unwrap();
    assert_eq!(
        message.code,
        ErrorCode::UnknownRequest,
        "{}",
        message.message
    );
    settled(&rig).await;
    let start = Instant::now();
    while rig.metrics.kv_blocks_used.get() != 0 {
        assert!(
            start.elapsed() < DEADLINE,
            "the cancelled prefill kept its blocks"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn reads_refused_before_acceptance_or_too_late_to_stream_read_the_publication() {
    let rig = rig().await;
    let prompt = prompt();

    // Room for fewer blocks than the tokens match: refused once the prefill runs, and
    // the publication stays readable by the params the prefill answers with.
    let expected = rig.service.expect("pdkv-r", &prompt).unwrap();
    let mut small = awaited_read("pdkv-r", &prompt);
    small.block_ids.truncate(2);
    let read = {
        let addr = rig.addr.clone();
        tokio::spawn(async move { pull(&addr, &small, 64, &PullConfig::default()).await })
    };
    let mut events = submit_prefill(&rig.engine, &expected);
    let err = tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(refused_as(&err, ErrorCode::BlockMismatch), "{err}");
    let params = publish_when_done(&rig.service, &mut events, expected).await;
    let by_params = ReadRequest {
        block_ids: params.remote_block_ids.as_ref().unwrap().flatten(),
        ..awaited_read("pdkv-r", &prompt)
    };
    let pulled = pull(&rig.addr, &by_params, 64, &PullConfig::default())
        .await
        .unwrap();
    assert_eq!(pulled.blocks.len(), BLOCKS);
    settled(&rig).await;

    // A reader that comes after the prefill finished reads the publication.
    let expected = rig.service.expect("pdkv-l", &prompt).unwrap();
    let feed = Some(expected.feed().clone());
    let pinned = finished_feeding(&rig.engine, prompt.clone(), feed).await;
    rig.service
        .publish_as(pinned, PublishKind::Prefill, Some("pdkv-l".into()))
        .unwrap();
    drop(expected);
    let pulled = pull(
        &rig.addr,
        &awaited_read("pdkv-l", &prompt),
        64,
        &PullConfig::default(),
    )
    .await
    .unwrap();
    assert_eq!(pulled.blocks[BLOCKS - 1], fake_block(&prompt, BLOCKS - 1));
    settled(&rig).await;

    // Nobody reads it at all: the abort timeout frees it.
    let expected = rig.service.expect("pdkv-n", &prompt).unwrap();
    let feed = Some(expected.feed().clone());
    let pinned = finished_feeding(&rig.engine, prompt.clone(), feed).await;
    rig.service
        .publish_as(pinned, PublishKind::Prefill, Some("pdkv-n".into()))
        .unwrap();
    drop(expected);
    assert_eq!(rig.metrics.kv.pinned_blocks.get(), BLOCKS as i64);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(rig.service.sweep().await, 1);
    settled(&rig).await;
    assert_eq!(
        rig.metrics.kv.blocks_streamed.get(),
        0,
        "nothing was streamed"
    );
}

#[tokio::test]
async fn a_read_that_gives_up_on_a_slow_prefill_leaves_the_publication_readable() {
    // Each chunk takes 60 ms; the read waits 10 ms for a block.
    let rig = rig_with(|s| s.with_block_wait(Duration::from_millis(10))).await;
    let prompt = prompt();
    let expected = rig.service.expect("pdkv-w", &prompt).unwrap();
    let read = {
        let (addr, read) = (rig.addr.clone(), awaited_read("pdkv-w", &prompt));
        tokio::spawn(async move { pull(&addr, &read, 64, &PullConfig::default()).await })
    };
    let mut events = submit_prefill(&rig.engine, &expected);
    let err = tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(refused_as(&err, ErrorCode::Internal), "{err}");
    // As the concurrent orchestrator's fallback does: read by the prefill's answer.
    let params = publish_when_done(&rig.service, &mut events, expected).await;
    let by_params = ReadRequest {
        block_ids: params.remote_block_ids.as_ref().unwrap().flatten(),
        ..awaited_read("pdkv-w", &prompt)
    };
    let pulled = pull(&rig.addr, &by_params, 64, &PullConfig::default())
        .await
        .unwrap();
    assert_eq!(pulled.blocks.len(), BLOCKS);
    settled(&rig).await;
    assert_eq!(rig.metrics.kv.serve_failures.get(), 1);
}

#[tokio::test]
async fn with_streaming_off_a_waiting_read_gets_its_blocks_once_the_prefill_ends() {
    let rig = rig_with(|s| s.with_streaming(false)).await;
    let prompt = prompt();
    let expected = rig.service.expect("pdkv-o", &prompt).unwrap();
    let mut s = raw_read(&rig.addr, &awaited_read("pdkv-o", &prompt)).await;
    let mut events = submit_prefill(&rig.engine, &expected);
    // Streamed, it would be accepted at admission; here nothing comes while it computes.
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(200), s.peek(&mut byte)).await;
    assert!(early.is_err(), "nothing is sent while the prefill computes");
    assert!(!has_finished(&mut events));
    let params = publish_when_done(&rig.service, &mut events, expected).await;
    // Accepted only now, from the publication.
    let accepted = frame(&mut s).await;
    assert_eq!(accepted.kind, FrameKind::ReadAccepted);
    for index in 0..BLOCKS {
        let block = frame(&mut s).await;
        assert_eq!(
            block.payload[4..],
            fake_block(&prompt, index),
            "block {index}"
        );
    }
    write_frame(&mut s, FrameKind::ReadComplete, &[])
        .await
        .unwrap();
    assert_eq!(params.remote_request_id.as_deref(), Some("pdkv-o"));
    settled(&rig).await;
    assert_eq!(rig.metrics.kv.blocks_streamed.get(), 0);
}
