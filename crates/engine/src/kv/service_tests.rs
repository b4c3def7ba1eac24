//! The service over a real scheduler (fake model) and real sockets on 127.0.0.1:0.

use std::time::Duration;

use pdserve_kv_transfer::{
    pull, ErrorCode, PullConfig, PulledBlocks, ReadRequest, ServerConfig, TransferError,
};
use tokio::net::TcpListener;

use super::*;
use crate::request::{GenerationRequest, SeqEvent};
use crate::scheduler::{spawn, SchedulerConfig};
use crate::step_model::fake::FakeModel;

const DEADLINE: Duration = Duration::from_secs(20);

/// A scheduler over the fake model (16 blocks of 16 tokens), and a KV service for it
/// serving reads on 127.0.0.1:0.
struct Rig {
    metrics: Arc<Metrics>,
    engine: EngineHandle,
    thread: std::thread::JoinHandle<()>,
    service: Arc<KvService>,
    addr: String,
    server: tokio::task::JoinHandle<()>,
}

impl Rig {
    async fn start(engine_id: &str, abort_timeout: Duration, conversation_budget: usize) -> Self {
        let metrics = Arc::new(Metrics::new());
        let config = SchedulerConfig {
            policy: crate::scheduler::SchedulingPolicy::Fcfs,
            max_num_seqs: 4,
            max_waiting: 8,
            max_num_batched_tokens: 256,
            max_model_len: 256,
        };
        let (engine, thread) = spawn(FakeModel::new(16), config, metrics.clone()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let service = Arc::new(KvService::new(
            KvServiceConfig {
                engine_id: engine_id.into(),
                layout: "fake".into(),
                block_bytes: 64,
                host: "127.0.0.1".into(),
                port: listener.local_addr().unwrap().port(),
                abort_timeout,
                conversation_budget,
            },
            engine.clone(),
            metrics.clone(),
        ));
        let server = tokio::spawn(pdserve_kv_transfer::server::serve(
            listener,
            service.clone(),
            ServerConfig::default(),
            std::future::pending(),
        ));
        Self {
            metrics,
            engine,
            thread,
            service,
            addr,
            server,
        }
    }
}

async fn finished_pinned(engine: &EngineHandle, prompt: Vec<u32>) -> PinnedKv {
    finished_feeding(engine, prompt, None).await
}

/// A finished `pin_on_finish` prefill of `prompt` that fed `feed` as it ran.
pub(super) async fn finished_feeding(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    feed: Option<Arc<crate::kv_feed::KvFeed>>,
) -> PinnedKv {
    let mut req = GenerationRequest::new(prompt, 1);
    req.pin_on_finish = true;
    req.kv_feed = feed;
    finished(engine, req).await
}

/// The pinned blocks `req` (a `pin_on_finish` request) left when it finished.
async fn finished(engine: &EngineHandle, req: GenerationRequest) -> PinnedKv {
    let mut events = engine.submit(req).unwrap();
    loop {
        match tokio::time::timeout(DEADLINE, events.recv()).await.unwrap() {
            Some(SeqEvent::Finished {
                pinned: Some(p), ..
            }) => return p,
            Some(SeqEvent::Finished { .. } | SeqEvent::Failed(_)) | None => {
                panic!("no pinned blocks")
            }
            Some(_) => {}
        }
    }
}

/// Stops what a [`Rig`] started: the KV service, then the scheduler thread.
fn stop(
    server: tokio::task::JoinHandle<()>,
    engine: EngineHandle,
    thread: std::thread::JoinHandle<()>,
) {
    server.abort();
    engine.shutdown();
    thread.join().unwrap();
}

/// Reads `prompt`'s blocks named by `params` from the service at `addr`.
async fn read_prompt(
    addr: &str,
    params: &KvTransferParams,
    prompt: &[u32],
) -> Result<PulledBlocks, TransferError> {
    pull(addr, &read_of(params, prompt), 64, &PullConfig::default()).await
}

async fn settle(metrics: &Metrics, pinned: i64) {
    let start = Instant::now();
    while metrics.kv_blocks_pinned.get() != pinned || metrics.kv.pinned_blocks.get() != pinned {
        assert!(start.elapsed() < DEADLINE, "pins never settled at {pinned}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn read_of(params: &KvTransferParams, tokens: &[u32]) -> ReadRequest {
    ReadRequest {
        engine_id: params.remote_engine_id.clone().unwrap(),
        request_id: params.remote_request_id.clone().unwrap(),
        block_ids: params.remote_block_ids.as_ref().unwrap().flatten(),
        token_ids: tokens.to_vec(),
        layout: "fake".into(),
        traceparent: None,
        tracestate: None,
    }
}

#[tokio::test]
async fn published_blocks_are_read_once_then_freed_or_expire_unread() {
    let Rig {
        metrics,
        engine,
        thread,
        service,
        addr,
        server,
    } = Rig::start("engine-p", Duration::from_millis(200), 4).await;
    let pull_config = PullConfig::default();

    let prompt: Vec<u32> = (1..=40).collect();
    let pinned = finished_pinned(&engine, prompt.clone()).await;
    assert_eq!(service.pending_exports(), 0);
    let params = service.publish(pinned, PublishKind::Prefill).unwrap();
    assert_eq!(service.pending_exports(), 1);
    assert!(params.do_remote_prefill && !params.do_remote_decode);
    assert_eq!(params.extra["tp_size"], 1);
    assert!(matches!(
        params.remote_block_ids,
        Some(RemoteBlockIds::Grouped(ref g)) if g.len() == 1 && g[0].len() == 3
    ));
    settle(&metrics, 3).await;

    // Wrong blocks or an unknown id are refused and leave the publication in place.
    let mut wrong = read_of(&params, &prompt);
    wrong.block_ids.reverse();
    let err = pull(&addr, &wrong, 64, &pull_config).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::BlockMismatch,
                ..
            }
        ),
        "{err}"
    );
    let mut unknown = read_of(&params, &prompt);
    unknown.request_id = "nope".into();
    let err = pull(&addr, &unknown, 64, &pull_config).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::UnknownRequest,
                ..
            }
        ),
        "{err}"
    );

    // A read of a longer token list that diverges at 20 gets the blocks of 20 tokens.
    let mut diverging = prompt.clone();
    diverging[20] = 99;
    let pulled = pull(&addr, &read_of(&params, &diverging), 64, &pull_config)
        .await
        .unwrap();
    assert_eq!((pulled.matched_tokens, pulled.blocks.len()), (20, 2));
    assert_eq!(&pulled.blocks[0][..4], &1u32.to_le_bytes());
    settle(&metrics, 0).await;
    assert_eq!(service.pending_exports(), 0);
    let err = pull(&addr, &read_of(&params, &prompt), 64, &pull_config)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::UnknownRequest,
                ..
            }
        ),
        "{err}"
    );

    // Unread blocks are freed after the abort timeout.
    let pinned = finished_pinned(&engine, prompt.clone()).await;
    service.publish(pinned, PublishKind::Prefill).unwrap();
    settle(&metrics, 3).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(service.sweep().await, 1);
    settle(&metrics, 0).await;
    assert_eq!(metrics.kv.aborted_by_timeout.get(), 1);

    // Conversations keep within their budget (4 blocks): the oldest is evicted.
    let first = finished_pinned(&engine, (1..=40).collect()).await;
    let first = service.publish(first, PublishKind::Conversation).unwrap();
    assert!(!first.do_remote_prefill && !first.do_remote_decode);
    assert_eq!(
        service.pending_exports(),
        0,
        "hand-backs are not waited for"
    );
    let second = finished_pinned(&engine, (2..=41).collect()).await;
    let second = service.publish(second, PublishKind::Conversation).unwrap();
    // Hand-backs are kept, not pinned.
    settle(&metrics, 0).await;
    assert_eq!(metrics.kv.evicted.get(), 1);
    let err = pull(&addr, &read_of(&first, &prompt), 64, &pull_config)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::UnknownRequest,
                ..
            }
        ),
        "{err}"
    );
    let turn: Vec<u32> = (2..=41).collect();
    let pulled = pull(&addr, &read_of(&second, &turn), 64, &pull_config)
        .await
        .unwrap();
    assert_eq!((pulled.matched_tokens, pulled.blocks.len()), (40, 3));
    settle(&metrics, 0).await;
    let too_big = finished_pinned(&engine, (3..=90).collect()).await;
    assert!(service
        .publish(too_big, PublishKind::Conversation)
        .is_none());
    tokio::time::sleep(Duration::from_millis(250)).await;
    service.sweep().await;
    settle(&metrics, 0).await;

    stop(server, engine, thread);
}

/// A read that waits for a publication under an id its reader chose: it gets the blocks
/// once they are published, fails at once when the announced prefill ends without
/// publishing, and the id cannot be announced twice.
#[tokio::test]
async fn awaited_reads_wait_for_their_publication_or_its_abandonment() {
    let Rig {
        metrics,
        engine,
        thread,
        service,
        addr,
        server,
    } = Rig::start("engine-p", Duration::from_secs(10), 4).await;
    let prompt: Vec<u32> = (1..=40).collect();
    let awaited_read = |id: &str| ReadRequest {
        engine_id: "engine-p".into(),
        request_id: id.into(),
        block_ids: awaited::awaited_block_ids(prompt.len()),
        token_ids: prompt.clone(),
        layout: "fake".into(),
        traceparent: None,
        tracestate: None,
    };
    assert!(awaited::is_awaited_read(&awaited_read("x")));

    // Announced, read started, then published: the read gets the blocks.
    let expected = service.expect("pdkv-a", &prompt).unwrap();
    assert!(
        service.expect("pdkv-a", &prompt).is_err(),
        "announced twice"
    );
    let read = {
        let (addr, read) = (addr.clone(), awaited_read("pdkv-a"));
        tokio::spawn(async move { pull(&addr, &read, 64, &PullConfig::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!read.is_finished(), "the read waits for the publication");
    // The prefill feeds the waiting read as it runs (see `streamed_tests`).
    let feed = Some(expected.feed().clone());
    let pinned = finished_feeding(&engine, prompt.clone(), feed).await;
    let params = service
        .publish_as(
            pinned,
            PublishKind::Prefill,
            Some(expected.id().to_string()),
        )
        .unwrap();
    drop(expected);
    assert_eq!(params.remote_request_id.as_deref(), Some("pdkv-a"));
    let pulled = tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((pulled.matched_tokens, pulled.blocks.len()), (40, 3));
    settle(&metrics, 0).await;

    // Announced, then abandoned (the prefill failed): the waiting read fails at once.
    let expected = service.expect("pdkv-b", &prompt).unwrap();
    let read = {
        let (addr, read) = (addr.clone(), awaited_read("pdkv-b"));
        tokio::spawn(async move { pull(&addr, &read, 64, &PullConfig::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    drop(expected);
    let err = tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::UnknownRequest,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "abandonment is seen at once"
    );

    // A publication under this worker's own id cannot be taken by an awaited read.
    let pinned = finished_pinned(&engine, prompt.clone()).await;
    let own = service.publish(pinned, PublishKind::Prefill).unwrap();
    let id = own.remote_request_id.clone().unwrap();
    assert!(service.expect(&id, &prompt).is_err(), "the id is in use");
    let err = pull(&addr, &awaited_read(&id), 64, &PullConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::BlockMismatch,
                ..
            }
        ),
        "{err}"
    );
    pull(&addr, &read_of(&own, &prompt), 64, &PullConfig::default())
        .await
        .unwrap();
    settle(&metrics, 0).await;

    stop(server, engine, thread);
}

/// A hand-back's blocks are reclaimed when the pool needs them; a later read is answered
/// `gone` (the reader computes instead) and the reclaim is counted.
#[tokio::test]
async fn handback_blocks_are_reclaimed_under_pressure_and_reads_get_gone() {
    let Rig {
        metrics,
        engine,
        thread,
        service,
        addr,
        server,
    } = Rig::start("engine-d", Duration::from_secs(60), 8).await;
    let prompt: Vec<u32> = (1..=40).collect();
    let pinned = finished_pinned(&engine, prompt.clone()).await;
    let params = service.publish(pinned, PublishKind::Conversation).unwrap();
    settle(&metrics, 0).await;

    // A request that needs the whole pool (16 blocks) reclaims the kept ones.
    let big: Vec<u32> = (1000..1000 + 250).collect();
    let mut events = engine.submit(GenerationRequest::new(big, 1)).unwrap();
    loop {
        match tokio::time::timeout(DEADLINE, events.recv()).await.unwrap() {
            Some(SeqEvent::Finished { .. }) => break,
            Some(SeqEvent::Failed(e)) => panic!("{e}"),
            None => panic!("no answer"),
            Some(_) => {}
        }
    }
    // Mirrored into the metric once the step that reclaimed them ends.
    let start = Instant::now();
    while metrics.kv.handback_reclaimed_blocks.get() != 3 {
        assert!(start.elapsed() < DEADLINE, "reclaims never counted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err = read_prompt(&addr, &params, &prompt).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote {
                code: ErrorCode::Gone,
                ..
            }
        ),
        "{err}"
    );
    settle(&metrics, 0).await;

    stop(server, engine, thread);
}

#[tokio::test]
async fn a_prefill_for_a_peer_is_read_from_the_copy_taken_as_it_finished() {
    let Rig {
        metrics,
        engine,
        thread,
        service,
        addr,
        server,
    } = Rig::start("engine-p", Duration::from_secs(20), 4).await;

    let prompt: Vec<u32> = (1..=40).collect();
    let mut req = GenerationRequest::new(prompt.clone(), 1);
    req.pin_on_finish = true;
    req.copy_on_finish = true;
    let pinned = finished(&engine, req).await;
    // The copy is the pool's content.
    let copy = pinned.bytes.clone().expect("copied as it finished").0;
    let pool = engine.read_blocks(pinned.blocks.clone()).await.unwrap();
    assert_eq!(copy, pool);
    // A read gets the copy, and the pins go when it completes.
    let params = service.publish(pinned, PublishKind::Prefill).unwrap();
    settle(&metrics, 3).await;
    let pulled = read_prompt(&addr, &params, &prompt).await.unwrap();
    assert_eq!(pulled.matched_tokens, 40);
    assert_eq!(pulled.blocks, pool);
    settle(&metrics, 0).await;
    assert_eq!(service.pending_exports(), 0);
    stop(server, engine, thread);
}
