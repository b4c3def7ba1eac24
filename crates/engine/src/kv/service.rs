//! The worker's KV transfer service: blocks it published for peers (a prefill's prompt
//! KV for the decode worker, or a decode worker's finished conversation for the next
//! turn's prefill), served over the `pdserve-kv-transfer` protocol. Published blocks are
//! freed when a peer has read them, when an accepted read breaks off, when the abort
//! timeout passes unread, or (conversations only) when they crowd the KV pool.
//!
//! A conversation hand-back is not pinned: its blocks are *kept* (see
//! `BlockManager::keep`), so the pool reclaims them when it needs the space; a read that
//! comes later is answered `gone` and the reader computes the prompt itself.
//!
//! A prefill may also be published under an id its reader chose (`publish_request_id`):
//! the reader then starts its read before the prefill has finished and the read waits
//! for the publication (see [`awaited`]), or, once the prefill runs, is served its
//! blocks as they are computed (see [`streamed`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pdserve_kv_transfer::{PinTable, ReusedTokens};
use pdserve_model::BlockId;
use pdserve_protocol::{KvTransferParams, RemoteBlockIds};
use serde_json::Value;
use tokio::sync::Notify;

use crate::kv_feed::KvFeed;
use crate::metrics::Metrics;
use crate::request::{BlockBytes, PinnedKv};
use crate::scheduler::EngineHandle;

/// Why blocks were published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishKind {
    /// A prefill's prompt KV, for the decode worker that gets the request next.
    Prefill,
    /// A finished P/D request's KV (prompt and output), for the conversation's next
    /// prefill. Best effort: evicted first when conversations crowd the pool.
    Conversation,
}

/// How the service is reached and what it may hold.
#[derive(Debug, Clone)]
pub struct KvServiceConfig {
    /// This engine's id (`remote_engine_id`).
    pub engine_id: String,
    /// The block format peers must share.
    pub layout: String,
    /// Bytes in one block.
    pub block_bytes: usize,
    /// Host peers connect to (`remote_host`).
    pub host: String,
    /// Port the service listens on (`remote_port`).
    pub port: u16,
    /// How long published blocks wait for a reader.
    pub abort_timeout: Duration,
    /// Most blocks held for conversations at once (the rest of the pool stays free for
    /// requests).
    pub conversation_budget: usize,
}

#[derive(Debug)]
struct Published {
    blocks: Vec<BlockId>,
    /// The tokens whose KV the blocks hold.
    tokens: Vec<u32>,
    kind: PublishKind,
    /// Published under an id the reader chose, so the reader cannot know the block ids.
    named_by_reader: bool,
    /// The keep handle of a conversation hand-back (its blocks are kept, not pinned).
    kept: Option<u64>,
    /// Leading tokens the publishing request did not compute, told to the reader.
    reused: ReusedTokens,
    /// When the publishing prefill finished (prefill publications only).
    finished_at: Option<Instant>,
    /// The blocks' bytes, copied as the prefill finished: a read is answered from them
    /// without waiting for the scheduler.
    bytes: Option<BlockBytes>,
}

/// An accepted read in progress.
#[derive(Debug, Default)]
struct Reading {
    /// The pinned blocks it frees when it ends (none yet for a streamed read whose
    /// prefill has not published).
    blocks: Vec<BlockId>,
    /// When the publishing prefill finished (prefill publications only).
    finished_at: Option<Instant>,
    /// The feed a streamed read takes its blocks from (see [`streamed`]).
    feed: Option<Arc<KvFeed>>,
}

#[derive(Debug, Default)]
struct State {
    pins: PinTable<Published>,
    /// Accepted reads in progress, by request id.
    reading: HashMap<String, Reading>,
    /// Conversation publications, oldest first (may name entries already gone).
    conversations: VecDeque<String>,
    conversation_blocks: usize,
    /// Reader-chosen ids whose prefill is running here, with the feed of its prompt's
    /// KV (see [`awaited`]).
    expected: HashMap<String, Arc<KvFeed>>,
    /// Reader-chosen ids whose streamed read ended before their prefill published: the
    /// publication is freed as it comes (see [`streamed`]).
    spent: HashSet<String>,
}

impl State {
    fn take(&mut self, request_id: &str) -> Option<Published> {
        let entry = self.pins.remove(request_id)?;
        if entry.kind == PublishKind::Conversation {
            self.conversation_blocks -= entry.blocks.len();
        }
        Some(entry)
    }
}

/// Published blocks of one engine, served to peers (implements
/// [`pdserve_kv_transfer::BlockSource`], see `read.rs`).
#[derive(Debug)]
pub struct KvService {
    config: KvServiceConfig,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// Woken whenever a publication appears or an expected one is abandoned.
    changed: Notify,
    /// Source of keep handles for conversation hand-backs.
    next_keep: AtomicU64,
    /// Longest wait of a streamed read for any one block (see [`streamed`]).
    block_wait: Duration,
    /// Whether reads that start before their prefill ends are streamed (`--kv-stream`).
    streaming: bool,
}

impl KvService {
    /// A service over `engine`'s KV pool; nothing is published yet.
    pub fn new(config: KvServiceConfig, engine: EngineHandle, metrics: Arc<Metrics>) -> Self {
        Self {
            config,
            engine,
            metrics,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            next_keep: AtomicU64::new(1),
            block_wait: streamed::BLOCK_WAIT,
            streaming: true,
        }
    }

    /// The same service streaming reads that start before their prefill ends
    /// (`--kv-stream`; on by default), or serving them once the prefill published.
    pub fn with_streaming(mut self, streaming: bool) -> Self {
        self.streaming = streaming;
        self
    }

    /// The same service with streamed reads waiting at most `wait` for any one block
    /// (default 20 s, under the readers' 30 s frame timeout; tests shorten it).
    pub fn with_block_wait(mut self, wait: Duration) -> Self {
        self.block_wait = wait;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent; a panic elsewhere must not
        // stop blocks from being freed.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long published blocks wait for a reader.
    pub fn abort_timeout(&self) -> Duration {
        self.config.abort_timeout
    }

    /// Prefill publications not read yet plus reads in progress: what decode peers still
    /// need from this worker. Conversation hand-backs are best effort and not counted.
    pub fn pending_exports(&self) -> usize {
        let st = self.lock();
        let unread = st.pins.values();
        unread.filter(|p| p.kind == PublishKind::Prefill).count() + st.reading.len()
    }

    /// Keeps `pinned` for a peer and returns the `kv_transfer_params` naming them, or
    /// `None` (blocks freed) when a conversation would not fit its budget.
    ///
    /// Synchronous on purpose: once the blocks left the scheduler they are either in the
    /// table (and the sweeper frees them) or being freed, with no await in between.
    pub fn publish(&self, pinned: PinnedKv, kind: PublishKind) -> Option<KvTransferParams> {
        self.publish_as(pinned, kind, None)
    }

    /// [`KvService::publish`] under `request_id` when given (a reader-chosen id, see
    /// [`awaited`]), else under a fresh one.
    pub fn publish_as(
        &self,
        pinned: PinnedKv,
        kind: PublishKind,
        request_id: Option<String>,
    ) -> Option<KvTransferParams> {
        let num_blocks = pinned.blocks.len();
        let mut evicted = Vec::new();
        let named_by_reader = request_id.is_some();
        let request_id =
            request_id.unwrap_or_else(|| format!("pdkv-{}", uuid::Uuid::new_v4().simple()));
        let params = self.params(&pinned, kind, request_id.clone());
        if named_by_reader && kind == PublishKind::Prefill {
            let mut st = self.lock();
            if let Some(route) = self.route_publication(&mut st, &request_id, &pinned) {
                drop(st);
                self.settle_streamed(&request_id, route, pinned.blocks);
                return Some(params);
            }
        }
        {
            let mut st = self.lock();
            if kind == PublishKind::Conversation {
                if num_blocks > self.config.conversation_budget {
                    drop(st);
                    release_unpublished(&self.engine, pinned.blocks);
                    return None;
                }
                while st.conversation_blocks + num_blocks > self.config.conversation_budget {
                    let Some(oldest) = st.conversations.pop_front() else {
                        break;
                    };
                    if let Some(entry) = st.take(&oldest) {
                        evicted.push(entry);
                    }
                }
                st.conversation_blocks += num_blocks;
                st.conversations.push_back(request_id.clone());
                // Forget ids that were read or expired meanwhile, so the queue stays bounded.
                if st.conversations.len() > 2 * st.pins.len() + 16 {
                    let State {
                        pins,
                        conversations,
                        ..
                    } = &mut *st;
                    conversations.retain(|id| pins.get(id).is_some());
                }
            }
            let deadline = Instant::now() + self.config.abort_timeout;
            let kept = (kind == PublishKind::Conversation)
                .then(|| self.next_keep.fetch_add(1, Ordering::Relaxed));
            if let Some(handle) = kept {
                // Under the lock, so a read of this entry queues its claim after the keep.
                if let Err(e) = self.engine.keep_evictable(handle, pinned.blocks.clone()) {
                    tracing::warn!("cannot keep a conversation's KV: {e}");
                    return None;
                }
            }
            let published = Published {
                blocks: pinned.blocks,
                tokens: pinned.tokens,
                kind,
                named_by_reader,
                kept,
                reused: pinned.reused,
                finished_at: (kind == PublishKind::Prefill).then_some(pinned.finished_at),
                bytes: pinned.bytes.filter(|_| kind == PublishKind::Prefill),
            };
            st.pins.insert(request_id, published, deadline);
        }
        if named_by_reader {
            self.changed.notify_waiters();
        }
        if kind == PublishKind::Prefill {
            self.metrics.kv.pinned_blocks.inc_by(num_blocks as i64);
        }
        self.metrics.kv.published.inc();
        for entry in evicted {
            self.metrics.kv.evicted.inc();
            self.drop_in_background(entry);
        }
        Some(params)
    }

    /// The `kv_transfer_params` naming `pinned` published as `kind` under `request_id`.
    fn params(&self, pinned: &PinnedKv, kind: PublishKind, request_id: String) -> KvTransferParams {
        let mut extra = serde_json::Map::new();
        extra.insert("tp_size".into(), Value::from(1));
        KvTransferParams {
            // A prefill's answer tells the proxy "decode remotely from here" (as vLLM's
            // NIXL connector does); a decode worker's hand-back is only a handle for the
            // proxy to give the next turn's prefill, so it asks nothing of anyone.
            do_remote_prefill: kind == PublishKind::Prefill,
            do_remote_decode: false,
            remote_engine_id: Some(self.config.engine_id.clone()),
            // One list per KV-cache group (one group: full attention everywhere).
            remote_block_ids: Some(RemoteBlockIds::Grouped(vec![pinned
                .blocks
                .iter()
                .map(|&b| u64::from(b))
                .collect()])),
            remote_host: Some(self.config.host.clone()),
            remote_port: Some(self.config.port),
            remote_request_id: Some(request_id),
            extra,
        }
    }

    /// Frees what is published under `request_id` if no reader has taken it yet (a
    /// bootstrap room its decode worker never claimed); false when nothing is there.
    pub fn withdraw(&self, request_id: &str) -> bool {
        let Some(entry) = self.lock().take(request_id) else {
            return false;
        };
        self.drop_in_background(entry);
        true
    }

    /// This engine's id (`remote_engine_id`).
    pub fn engine_id(&self) -> &str {
        &self.config.engine_id
    }

    /// Frees what is published under `request_id` at once (`POST /v1/kv/release`: the
    /// decode leg that would have read it failed). Returns the blocks freed, or `None`
    /// when nothing is published under it (never, already read or released, expired,
    /// or a read is in progress, which frees the blocks when it ends).
    pub async fn release(&self, request_id: &str) -> Option<usize> {
        let entry = self.lock().take(request_id)?;
        let blocks = entry.blocks.len();
        self.metrics.kv.released.inc();
        tracing::info!(
            request_id,
            blocks,
            "published KV blocks released on request"
        );
        self.free(entry).await;
        Some(blocks)
    }

    /// Frees every publication whose abort deadline passed; returns how many.
    pub async fn sweep(&self) -> usize {
        let expired = {
            let mut st = self.lock();
            let expired = st.pins.remove_expired(Instant::now());
            for (_, entry) in &expired {
                if entry.kind == PublishKind::Conversation {
                    st.conversation_blocks -= entry.blocks.len();
                }
            }
            expired
        };
        let count = expired.len();
        for (request_id, entry) in expired {
            tracing::info!(
                request_id,
                blocks = entry.blocks.len(),
                "published KV blocks were not read within the abort timeout; freed"
            );
            self.metrics.kv.aborted_by_timeout.inc();
            self.free(entry).await;
        }
        count
    }

    /// Runs [`KvService::sweep`] periodically (a fraction of the abort timeout) forever.
    pub async fn sweep_forever(self: Arc<Self>) {
        let period = (self.config.abort_timeout / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.sweep().await;
        }
    }

    /// Frees a publication taken out of the table: unpins a prefill's blocks, ends a
    /// hand-back's keep.
    async fn free(&self, entry: Published) {
        match entry.kept {
            Some(handle) => self.engine.forget_kept(handle),
            None => release(&self.engine, &self.metrics, entry.blocks).await,
        }
    }

    /// [`KvService::free`] without waiting (from synchronous code).
    fn drop_in_background(&self, entry: Published) {
        match entry.kept {
            Some(handle) => self.engine.forget_kept(handle),
            None => self.release_in_background(entry.blocks),
        }
    }

    fn release_in_background(&self, blocks: Vec<BlockId>) {
        let engine = self.engine.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move { release(&engine, &metrics, blocks).await });
    }
}

/// Unpins published blocks and updates the gauge.
async fn release(engine: &EngineHandle, metrics: &Metrics, blocks: Vec<BlockId>) {
    let n = blocks.len() as i64;
    if let Err(e) = engine.unpin(blocks).await {
        tracing::error!("unpinning published KV blocks failed: {e}");
    }
    metrics.kv.pinned_blocks.dec_by(n);
}

/// Unpins blocks a finished sequence left pinned but that were never published.
pub fn release_unpublished(engine: &EngineHandle, blocks: Vec<BlockId>) {
    let engine = engine.clone();
    let unpin = async move {
        if let Err(e) = engine.unpin(blocks).await {
            tracing::error!("unpinning unpublished KV blocks failed: {e}");
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(unpin);
        }
        Err(_) => tracing::error!("no runtime to unpin KV blocks on; they stay pinned"),
    }
}

/// Leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_counts_leading_equal_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[7, 8], &[7, 8]), 2);
    }
}

#[path = "awaited.rs"]
pub mod awaited;

#[path = "read.rs"]
mod read;

#[path = "streamed.rs"]
pub mod streamed;

#[cfg(test)]
#[path = "service_tests.rs"]
mod service_tests;

#[cfg(test)]
#[path = "streamed_tests.rs"]
mod streamed_tests;
