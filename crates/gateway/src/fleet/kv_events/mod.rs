//! What the workers' own KV-cache events say they cache, in either of the layouts vLLM
//! is deployed with:
//!
//! - subscription: every worker with an event endpoint (from `--kv-events`, its
//!   registration, its listing entry or its pod's annotations) binds it, and gets a
//!   subscriber task here;
//! - central collector (llm-d's, `--kv-events-bind`): this gateway binds one socket,
//!   every worker's publisher connects to it, and each message's topic
//!   (`kv@HOST:PORT@MODEL`) names the worker it belongs to.
//!
//! Either way each worker gets an index of its cached blocks, which goes when the worker
//! leaves the roster. Events are the same for every gateway replica that hears them, so
//! replicas that route on them agree without sharing anything.
//!
//! - [`index`]: a worker's blocks under the gateway's own chained keys ([`keys`]).
//! - [`first_blocks`]: which workers hold each prompt's first block, fleet-wide.
//! - [`subscriber`]: a worker's stream: the SUB socket, sequence checks, replays and
//!   rebuilds.
//! - [`collector`]: the bound socket and the topic convention.

mod args;
pub mod collector;
pub mod first_blocks;
pub mod index;
pub mod keys;
mod metrics;
pub mod subscriber;

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

pub use args::{check_endpoint, KvEventsArgs, KvEventsConfig};
pub use first_blocks::FirstBlocks;
pub use index::BlockIndex;
pub use keys::{prompt_keys, BlockKey, PromptKeys};
pub use metrics::KvEventMetrics;
pub use subscriber::EventEndpoints;

use crate::fleet::registry::{url_id, Registry, WorkerSpec};

/// The workers' indexes by URL, and by the URL's id ([`url_id`]) for routing.
#[derive(Debug, Default)]
struct Indexes {
    by_url: HashMap<String, Arc<WorkerEvents>, foldhash::fast::FixedState>,
    by_id: HashMap<u64, Arc<WorkerEvents>, foldhash::fast::FixedState>,
}

impl Indexes {
    /// The index of `url`, made by `new` if it has none.
    fn get_or_insert(
        &mut self,
        url: &str,
        new: impl FnOnce() -> Arc<WorkerEvents>,
    ) -> Arc<WorkerEvents> {
        if let Some(events) = self.by_url.get(url) {
            return events.clone();
        }
        let events = new();
        self.insert(url.to_string(), events.clone());
        events
    }

    fn insert(&mut self, url: String, events: Arc<WorkerEvents>) {
        self.by_id.insert(url_id(&url), events.clone());
        self.by_url.insert(url, events);
    }

    fn remove(&mut self, url: &str) {
        self.by_id.remove(&url_id(url));
        self.by_url.remove(url);
    }

    /// Keeps the indexes of the URLs `keep` says yes to.
    fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.by_url.retain(|url, _| keep(url));
        let ids: std::collections::HashSet<u64> = self.by_url.keys().map(|u| url_id(u)).collect();
        self.by_id.retain(|id, _| ids.contains(id));
    }
}

/// One worker's index and when its stream last said something.
///
/// `repr(C)`, the fields a routing decision reads of every candidate first: they share
/// the line the allocation starts with instead of lying past the index.
#[derive(Debug)]
#[repr(C)]
pub struct WorkerEvents {
    /// The index's block size (0: not said yet), written as each lock is released, so
    /// a routing decision reads it, and whether the index can hold a prompt at all (see
    /// `first_block_id`), without taking every candidate's lock.
    block_size: AtomicU32,
    /// Events were owed for longer than `--kv-events-stale-secs`: the index is not
    /// trusted until the stream speaks again.
    stale: AtomicBool,
    /// The index's number in the fleet's first-block map (fixed for its life).
    first_block_id: Option<first_blocks::IndexId>,
    index: Mutex<BlockIndex>,
    last_heard: Mutex<Option<Instant>>,
    /// When the gateway first sent the worker a prompt it must compute new blocks for
    /// after the last batch arrived: events are owed since then.
    owed_since: Mutex<Option<Instant>>,
}

impl WorkerEvents {
    /// An empty index of at most `capacity` blocks.
    pub fn new(capacity: NonZeroUsize) -> Self {
        Self::of_index(BlockIndex::new(capacity))
    }

    /// An empty index of at most `capacity` blocks that reports its first blocks to
    /// `first_blocks`.
    fn reporting(capacity: NonZeroUsize, first_blocks: &Arc<FirstBlocks>) -> Self {
        let sink = first_blocks::FirstBlockSink::new(first_blocks.clone());
        Self::of_index(BlockIndex::reporting(capacity, sink))
    }

    fn of_index(index: BlockIndex) -> Self {
        Self {
            block_size: AtomicU32::new(index.block_size().unwrap_or(0)),
            first_block_id: index.first_block_id(),
            index: Mutex::new(index),
            last_heard: Mutex::new(None),
            owed_since: Mutex::new(None),
            stale: AtomicBool::new(false),
        }
    }

    /// The index, locked.
    pub fn lock(&self) -> IndexGuard<'_> {
        IndexGuard {
            // The index is rebuilt from events anyway: a panic elsewhere cannot tear it.
            index: self.index.lock().unwrap_or_else(|e| e.into_inner()),
            block_size: &self.block_size,
        }
    }

    /// The index's block size as of its last unlock, read without locking it.
    pub fn block_size(&self) -> Option<u32> {
        Some(self.block_size.load(Ordering::Relaxed)).filter(|b| *b > 0)
    }

    /// The index's number in the fleet's first-block map, when it reports there.
    pub fn first_block_id(&self) -> Option<first_blocks::IndexId> {
        self.first_block_id
    }

    /// Empties the index (it fills again from new events).
    pub fn reset(&self) {
        self.lock().clear();
    }

    /// Records that a batch arrived at `at`: the stream is alive, nothing is owed.
    pub fn heard(&self, at: Instant) {
        *self.last_heard.lock().unwrap_or_else(|e| e.into_inner()) = Some(at);
        *self.owed_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.stale.store(false, Ordering::Relaxed);
    }

    /// Records that the worker was just sent a prompt it will compute new blocks for, so
    /// its stream owes events (a stream that owes them for too long goes stale).
    pub fn expect_events(&self) {
        self.owed_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(Instant::now);
    }

    /// Marks the index stale when events have been owed for longer than `stale_after`;
    /// true when it just went stale.
    pub fn check_stale(&self, stale_after: Duration) -> bool {
        let owed = *self.owed_since.lock().unwrap_or_else(|e| e.into_inner());
        let overdue = owed.is_some_and(|since| since.elapsed() > stale_after);
        overdue && !self.stale.swap(true, Ordering::Relaxed)
    }

    /// Whether the index is stale (events owed too long; cleared by the next batch).
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// When the last batch arrived.
    pub fn last_heard(&self) -> Option<Instant> {
        *self.last_heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens of `tokens` from the start that the worker holds, in whole blocks; `None`
    /// before its events have said its block size, and while the index is stale.
    pub fn cached_tokens(&self, tokens: &[u32]) -> Option<usize> {
        if self.is_stale() {
            return None;
        }
        let index = self.lock();
        let block_size = index.block_size()? as usize;
        let keys = prompt_keys(tokens, block_size);
        Some(index.cached_prefix(&keys) * block_size)
    }
}

/// A locked index; unlocking publishes its block size to [`WorkerEvents::block_size`].
#[derive(Debug)]
pub struct IndexGuard<'a> {
    index: MutexGuard<'a, BlockIndex>,
    block_size: &'a AtomicU32,
}

impl std::ops::Deref for IndexGuard<'_> {
    type Target = BlockIndex;

    fn deref(&self) -> &BlockIndex {
        &self.index
    }
}

impl std::ops::DerefMut for IndexGuard<'_> {
    fn deref_mut(&mut self) -> &mut BlockIndex {
        &mut self.index
    }
}

impl Drop for IndexGuard<'_> {
    fn drop(&mut self) {
        let size = self.index.block_size().unwrap_or(0);
        self.block_size.store(size, Ordering::Relaxed);
    }
}

/// Every worker's event subscription and index.
#[derive(Debug)]
pub struct KvEventsHub {
    config: KvEventsConfig,
    metrics: Arc<KvEventMetrics>,
    /// By worker URL, and by its id for routing decisions.
    workers: RwLock<Indexes>,
    subscriptions: Mutex<HashMap<String, (EventEndpoints, JoinHandle<()>)>>,
    /// Which of the indexes hold each prompt's first block.
    first_blocks: Arc<FirstBlocks>,
}

impl Drop for KvEventsHub {
    fn drop(&mut self) {
        let subscriptions = self
            .subscriptions
            .get_mut()
            .unwrap_or_else(|e| e.into_inner());
        for (_, (_, task)) in subscriptions.drain() {
            task.abort();
        }
    }
}

impl KvEventsHub {
    /// No subscriptions yet.
    pub fn new(config: KvEventsConfig, metrics: Arc<KvEventMetrics>) -> Self {
        Self {
            config,
            metrics,
            workers: RwLock::default(),
            subscriptions: Mutex::default(),
            first_blocks: Arc::default(),
        }
    }

    /// Which of this hub's indexes hold each prompt's first block.
    pub fn first_blocks(&self) -> &FirstBlocks {
        &self.first_blocks
    }

    /// The events of the worker at `url` (its registry key), if it publishes any.
    pub fn worker(&self, url: &str) -> Option<Arc<WorkerEvents>> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_url
            .get(url)
            .cloned()
    }

    /// Calls `f` with the events of the workers of each of `ids` ([`crate::fleet::registry::Worker::id`]), in
    /// their order, under one read of the roster (no URL hashed or compared, no reference
    /// counts touched: a routing decision reads a whole fleet's).
    pub fn with_ids<R>(&self, ids: &[u64], f: impl FnOnce(&[Option<&WorkerEvents>]) -> R) -> R {
        let indexes = self.workers.read().unwrap_or_else(|e| e.into_inner());
        let events: Vec<Option<&WorkerEvents>> = ids
            .iter()
            .map(|id| indexes.by_id.get(id).map(|e| &**e))
            .collect();
        f(&events)
    }

    /// Calls `f` with the events of the worker of `id`, as [`Self::with_ids`] does for
    /// one.
    pub fn with_id<R>(&self, id: u64, f: impl FnOnce(Option<&WorkerEvents>) -> R) -> R {
        let indexes = self.workers.read().unwrap_or_else(|e| e.into_inner());
        f(indexes.by_id.get(&id).map(|e| &**e))
    }

    /// Where `spec`'s events come from: `--kv-events` for its URL, else what it was
    /// registered with.
    pub fn endpoints(&self, spec: &WorkerSpec) -> Option<EventEndpoints> {
        let key = spec.key();
        let publisher = self
            .config
            .publishers
            .get(&key)
            .cloned()
            .or_else(|| spec.kv_events_endpoint.clone())?;
        let replay = self
            .config
            .replays
            .get(&key)
            .cloned()
            .or_else(|| spec.kv_events_replay_endpoint.clone());
        Some(EventEndpoints { publisher, replay })
    }

    /// The index the collector fills for the worker at `url` (made on first use);
    /// `None` when the worker is subscribed to, whose subscription fills its index.
    pub fn collected(&self, url: &str) -> Option<Arc<WorkerEvents>> {
        let subscriptions = self.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
        if subscriptions.contains_key(url) {
            return None;
        }
        // Every collected message asks: the read lock, unless the index is new.
        if let Some(events) = self.worker(url) {
            return Some(events);
        }
        let mut workers = self.workers.write().unwrap_or_else(|e| e.into_inner());
        Some(workers.get_or_insert(url, || {
            Arc::new(WorkerEvents::reporting(
                self.config.max_indexed_blocks,
                &self.first_blocks,
            ))
        }))
    }

    /// Subscribes to every roster worker that publishes events and drops what left:
    /// a worker that left takes its index with it (subscribed or collected); one whose
    /// endpoints changed starts over.
    pub fn reconcile(&self, registry: &Registry) {
        let roster = registry.snapshot();
        let members: std::collections::HashSet<&str> = roster
            .members()
            .iter()
            .map(|m| m.worker.base.as_str())
            .collect();
        let wanted: HashMap<String, EventEndpoints> = roster
            .members()
            .iter()
            .filter_map(|m| Some((m.worker.base.clone(), self.endpoints(&m.worker.spec)?)))
            .collect();
        let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
        let mut workers = self.workers.write().unwrap_or_else(|e| e.into_inner());
        subscriptions.retain(|url, (endpoints, task)| {
            let keep = wanted.get(url) == Some(endpoints);
            if !keep {
                task.abort();
                workers.remove(url);
                self.metrics.forget(url);
                tracing::info!(worker = %url, "KV events: unsubscribed");
            }
            keep
        });
        // Collected indexes (no subscription) of workers that left the roster.
        workers.retain(|url| {
            let keep = subscriptions.contains_key(url) || members.contains(url);
            if !keep {
                self.metrics.forget(url);
            }
            keep
        });
        for (url, endpoints) in wanted {
            if subscriptions.contains_key(&url) {
                continue;
            }
            let events = Arc::new(WorkerEvents::reporting(
                self.config.max_indexed_blocks,
                &self.first_blocks,
            ));
            workers.insert(url.clone(), events.clone());
            let task = tokio::spawn(subscriber::follow(
                url.clone(),
                endpoints.clone(),
                events,
                self.metrics.clone(),
                self.config.stale_after,
            ));
            subscriptions.insert(url, (endpoints, task));
        }
    }

    /// Keeps the subscriptions in step with the roster until aborted.
    pub fn spawn(self: &Arc<Self>, registry: Arc<Registry>) -> JoinHandle<()> {
        let hub = self.clone();
        tokio::spawn(async move {
            let mut changes = registry.subscribe();
            loop {
                hub.reconcile(&registry);
                if changes.changed().await.is_err() {
                    return;
                }
            }
        })
    }
}
