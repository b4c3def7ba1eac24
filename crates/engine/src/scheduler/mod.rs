//! Continuous batching on a dedicated OS thread.
//!
//! Each step: drop cancelled sequences; give every running sequence its next tokens (one
//! decode token, or the next chunk of its prompt) within a token budget, preempting the
//! most recently admitted sequences when KV blocks run out; admit waiting sequences
//! (prefix-cache lookup first) while budget, batch slots and blocks allow; run ONE batched
//! forward; sample, stream tokens out, and retire finished sequences.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdserve_kv_transfer::ReusedTokens;
use pdserve_model::{BlockId, ModelError, SequenceStep, BLOCK_SIZE};
use tokio::sync::{mpsc, oneshot};

use crate::block_manager::{BlockError, BlockManager, PrefixHit};
use crate::heartbeat::{Heartbeat, SchedulerCondition};
use crate::kv_events::{CacheNews, EventSink};
use crate::metrics::Metrics;
use crate::profile::{token_split, Profiler, StepSpan};
use crate::request::{FinishReason, GenerationRequest, PinnedKv, SeqEvent, SeqEvents};
use crate::scheduling::Priority;
pub use crate::scheduling::SchedulingPolicy;
use crate::sequence::Sequence;
use crate::step_model::StepModel;

/// How often a stalled scheduler (work waiting, no block free) looks again.
const STALL_POLL: Duration = Duration::from_millis(5);
/// How often an idle scheduler beats its heartbeat: the beat must stay fresh while idle
/// so that a request arriving after a long idle spell never looks like a wedge.
const IDLE_BEAT: Duration = Duration::from_secs(1);

/// Limits of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most requests waiting for admission; more are refused (HTTP 429).
    pub max_waiting: usize,
    /// Most tokens run in one step (prompt chunks plus decode tokens).
    pub max_num_batched_tokens: usize,
    /// Most tokens (prompt plus generated) of one sequence.
    pub max_model_len: usize,
    /// Which sequences get each step's token budget first.
    pub policy: SchedulingPolicy,
}

/// How far one pass over the running batch got.
#[derive(Debug, Default)]
struct RunningPass {
    /// Sequences were preempted for blocks (no admission this step).
    preempted: bool,
    /// The pass stopped here so that a waiting sequence with less work goes first.
    yielded_at: Option<usize>,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The bounded waiting queue is full.
    #[error("the server is at capacity: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    /// The scheduler thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// A non-zero `priority` without `--scheduling-policy priority` (as vLLM refuses it).
    #[error(
        "priority scheduling is not enabled (start the worker with --scheduling-policy priority)"
    )]
    PriorityNotEnabled,
}

/// Why a KV block operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A block to read is not pinned (never exported, or already released).
    #[error("block {0} is not pinned")]
    NotPinned(BlockId),
    /// The block manager refused the operation.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The scheduler thread is gone.
    #[error("the engine has stopped")]
    Stopped,
}

type Reply<T> = oneshot::Sender<Result<T, KvError>>;

enum Command {
    Submit(Box<GenerationRequest>, mpsc::UnboundedSender<SeqEvent>),
    ReadBlocks(Vec<BlockId>, Reply<Vec<Vec<u8>>>),
    Unpin(Vec<BlockId>, Reply<()>),
    /// Turns pins into a keep under a handle (see `BlockManager::keep`).
    Keep(u64, Vec<BlockId>),
    ClaimKept(u64, Reply<Option<Vec<BlockId>>>),
    ForgetKept(u64),
    Shutdown,
}

/// A cheap, cloneable handle to submit requests to the scheduler thread.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    /// Requests accepted but never admitted to the running batch yet.
    queued: Arc<AtomicUsize>,
    max_waiting: usize,
    /// Whether a request's `priority` is honoured.
    honours_priority: bool,
    heartbeat: Arc<Heartbeat>,
    profiler: Arc<Profiler>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Submit(..) => f.write_str("Submit"),
            Self::ReadBlocks(ids, _) => write!(f, "ReadBlocks({} blocks)", ids.len()),
            Self::Unpin(ids, _) => write!(f, "Unpin({} blocks)", ids.len()),
            Self::Keep(handle, ids) => write!(f, "Keep({handle}, {} blocks)", ids.len()),
            Self::ClaimKept(handle, _) => write!(f, "ClaimKept({handle})"),
            Self::ForgetKept(handle) => write!(f, "ForgetKept({handle})"),
            Self::Shutdown => f.write_str("Shutdown"),
        }
    }
}

impl EngineHandle {
    /// Queues `request`; its output arrives on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(&self, request: GenerationRequest) -> Result<SeqEvents, SubmitError> {
        if request.priority != 0 && !self.honours_priority {
            return Err(SubmitError::PriorityNotEnabled);
        }
        let reserved = self
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_waiting).then_some(n + 1)
            });
        if reserved.is_err() {
            return Err(SubmitError::QueueFull(self.max_waiting));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        if self
            .commands
            .send(Command::Submit(Box::new(request), tx))
            .is_err()
        {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(rx)
    }

    /// Copies pinned blocks out of the KV pool (between scheduler steps).
    pub async fn read_blocks(&self, ids: Vec<BlockId>) -> Result<Vec<Vec<u8>>, KvError> {
        self.call(|reply| Command::ReadBlocks(ids, reply)).await
    }

    /// Drops the pins a `pin_on_finish` sequence left on `ids`.
    pub async fn unpin(&self, ids: Vec<BlockId>) -> Result<(), KvError> {
        self.call(|reply| Command::Unpin(ids, reply)).await
    }

    /// Turns the pins a `pin_on_finish` sequence left on `ids` into a keep under
    /// `handle`: the blocks stay readable until the pool needs them. Queued in order
    /// with every other command, so a later claim sees it.
    pub fn keep_evictable(&self, handle: u64, ids: Vec<BlockId>) -> Result<(), KvError> {
        self.commands
            .send(Command::Keep(handle, ids))
            .map_err(|_| KvError::Stopped)
    }

    /// Pins the blocks kept under `handle` for a read, or `None` when the pool has
    /// reclaimed any of them (or nothing is kept under it).
    pub async fn claim_kept(&self, handle: u64) -> Result<Option<Vec<BlockId>>, KvError> {
        self.call(|reply| Command::ClaimKept(handle, reply)).await
    }

    /// Ends the keep under `handle` (its blocks become plain free or cached blocks).
    pub fn forget_kept(&self, handle: u64) {
        let _ = self.commands.send(Command::ForgetKept(handle));
    }

    async fn call<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, KvError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(command(tx))
            .map_err(|_| KvError::Stopped)?;
        rx.await.map_err(|_| KvError::Stopped)?
    }

    /// The scheduler's step profiler (`/start_profile`, `/stop_profile`).
    pub fn profiler(&self) -> &Arc<Profiler> {
        &self.profiler
    }

    /// Asks the scheduler thread to fail every sequence and exit.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// Whether the scheduler thread is alive and, with work to do, still completing
    /// steps within `wedged_after`.
    pub fn condition(&self, wedged_after: Duration) -> SchedulerCondition {
        let queued = self.queued.load(Ordering::SeqCst) > 0;
        self.heartbeat.condition(wedged_after, queued)
    }
}

/// Starts the scheduler thread over `model`.
pub fn spawn<M: StepModel>(
    model: M,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<(EngineHandle, JoinHandle<()>)> {
    spawn_publishing(model, config, metrics, None)
}

/// [`spawn`], telling `events` (when given) of every change to the prefix cache: a clear
/// first, then each step's stores and removals.
pub fn spawn_publishing<M: StepModel>(
    model: M,
    mut config: SchedulerConfig,
    metrics: Arc<Metrics>,
    events: Option<EventSink>,
) -> std::io::Result<(EngineHandle, JoinHandle<()>)> {
    // A sequence must always fit in the pool on its own, or preemption could not help.
    config.max_model_len = config.max_model_len.min(model.num_blocks() * BLOCK_SIZE);
    let (tx, rx) = std_mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let heartbeat = Arc::new(Heartbeat::default());
    let profiler = Arc::new(Profiler::default());
    let handle = EngineHandle {
        commands: tx,
        queued: queued.clone(),
        max_waiting: config.max_waiting,
        honours_priority: config.policy.honours_priority(),
        heartbeat: heartbeat.clone(),
        profiler: profiler.clone(),
    };
    let exit_guard = heartbeat.exit_guard();
    let mut blocks = BlockManager::new(model.num_blocks());
    if let Some(sink) = &events {
        blocks.record_changes();
        sink.send(CacheNews::Cleared);
    }
    let scheduler = Scheduler {
        blocks,
        events,
        model,
        config,
        metrics,
        queued,
        waiting: VecDeque::new(),
        running: Vec::new(),
        stopping: false,
        heartbeat,
        profiler,
    };
    let thread = std::thread::Builder::new()
        .name("pdserve-scheduler".into())
        .spawn(move || {
            let _exit_guard = exit_guard;
            scheduler.run(rx)
        })?;
    Ok((handle, thread))
}

struct Scheduler<M> {
    model: M,
    blocks: BlockManager,
    /// Where prefix-cache changes go (`--kv-events-config`).
    events: Option<EventSink>,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stopping: bool,
    heartbeat: Arc<Heartbeat>,
    profiler: Arc<Profiler>,
}

impl<M: StepModel> Scheduler<M> {
    fn run(mut self, commands: std_mpsc::Receiver<Command>) {
        let mut stalled = false;
        loop {
            self.heartbeat.beat(self.has_work());
            if !self.has_work() {
                // Idle: wait for work (or for every handle to go).
                match commands.recv_timeout(IDLE_BEAT) {
                    Ok(cmd) => self.handle(cmd),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else if stalled {
                // Work is waiting for blocks that only a command (or a cancellation) can
                // free: poll instead of spinning.
                match commands.recv_timeout(STALL_POLL) {
                    Ok(cmd) => self.handle(cmd),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            while let Ok(cmd) = commands.try_recv() {
                self.handle(cmd);
            }
            if self.stopping {
                break;
            }
            // Beat with the work this step takes on, so a step that never ends with
            // sequences in hand reads as a wedge.
            self.heartbeat.beat(self.has_work());
            stalled = !self.step();
            self.publish_changes();
        }
        let waiting: Vec<_> = self.waiting.drain(..).collect();
        for seq in self.running.drain(..).chain(waiting) {
            seq.send(SeqEvent::Failed("the worker is shutting down".into()));
        }
        tracing::debug!("scheduler thread stopped");
    }

    /// Hands the prefix-cache changes of this step (and of the commands before it) to
    /// the KV-event publisher.
    fn publish_changes(&mut self) {
        if let Some(sink) = &self.events {
            let changes = self.blocks.drain_changes();
            if !changes.is_empty() {
                sink.send(CacheNews::Changes(changes));
            }
        }
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(request, events) => {
                let mut seq = Sequence::new(*request, events);
                if let Err(msg) = self.check_fits(&seq) {
                    self.release_queue_slot(&mut seq);
                    seq.send(SeqEvent::Failed(msg));
                    self.metrics.finished("error");
                    return;
                }
                self.waiting.push_back(seq);
            }
            Command::ReadBlocks(ids, reply) => {
                let _ = reply.send(self.read_pinned(&ids));
            }
            Command::Unpin(ids, reply) => {
                let result = self.blocks.unpin(&ids).map_err(KvError::from);
                self.update_gauges();
                let _ = reply.send(result);
            }
            Command::Keep(handle, ids) => {
                // Unpinned even if the keep fails: a claim then answers "gone".
                let kept = self.blocks.keep(handle, &ids);
                if let Err(e) = kept.and(self.blocks.unpin(&ids)) {
                    tracing::error!("keeping a conversation's KV blocks failed: {e}");
                }
                self.update_gauges();
            }
            Command::ClaimKept(handle, reply) => {
                let _ = reply.send(Ok(self.blocks.claim(handle)));
                self.update_gauges();
            }
            Command::ForgetKept(handle) => {
                self.blocks.forget(handle);
                self.update_gauges();
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    fn read_pinned(&self, ids: &[BlockId]) -> Result<Vec<Vec<u8>>, KvError> {
        if let Some(&id) = ids.iter().find(|&&id| !self.blocks.is_pinned(id)) {
            return Err(KvError::NotPinned(id));
        }
        Ok(ids.iter().map(|&id| self.model.read_block(id)).collect())
    }

    /// Last line of defence behind the HTTP validation: a request that can never run
    /// is refused instead of blocking the queue.
    fn check_fits(&self, seq: &Sequence) -> Result<(), String> {
        if seq.prompt_len == 0 {
            return Err("the prompt is empty".into());
        }
        if let Some(import) = seq.kv_import() {
            if seq.scores_prompt() {
                return Err("prompt logprobs need the whole prompt computed here, \
                            not imported KV"
                    .into());
            }
            if import.num_tokens == 0
                || import.num_tokens >= seq.prompt_len
                || import.blocks.len() != import.num_tokens.div_ceil(BLOCK_SIZE)
            {
                return Err(format!(
                    "imported KV must cover 1..{} prompt tokens in whole blocks; got {} blocks for {} tokens",
                    seq.prompt_len,
                    import.blocks.len(),
                    import.num_tokens
                ));
            }
        }
        if seq.prompt_len >= self.config.max_model_len {
            return Err(format!(
                "the prompt has {} tokens; this worker's limit is {}",
                seq.prompt_len,
                self.config.max_model_len.saturating_sub(1)
            ));
        }
        Ok(())
    }

    fn release_queue_slot(&self, seq: &mut Sequence) {
        if std::mem::take(&mut seq.holds_queue_slot) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Frees the sequence's blocks and queue slot. Block errors are bugs; they are logged
    /// rather than allowed to take the worker down.
    fn retire(&mut self, seq: &mut Sequence) {
        if let Err(e) = seq.release_blocks(&mut self.blocks) {
            tracing::error!("releasing a sequence's blocks failed: {e}");
        }
        self.release_queue_slot(seq);
    }

    fn reap_cancelled(&mut self) {
        let mut cancelled = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_cancelled() {
                cancelled.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        let (gone, kept): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(Sequence::is_cancelled);
        self.waiting = kept.into();
        let any = !cancelled.is_empty() || !gone.is_empty();
        for mut seq in cancelled.into_iter().chain(gone) {
            self.retire(&mut seq);
            self.metrics.finished("abort");
        }
        if any {
            self.update_gauges();
        }
    }

    /// Moves `running[index]` back to the head of the queue; it is recomputed later.
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        if let Err(e) = seq.release_blocks(&mut self.blocks) {
            tracing::error!("releasing a preempted sequence's blocks failed: {e}");
        }
        self.metrics.preemptions.inc();
        tracing::debug!(tokens = seq.tokens.len(), "preempted a sequence");
        self.waiting.push_front(seq);
    }

    /// One scheduling step; false when nothing could run.
    fn step(&mut self) -> bool {
        self.reap_cancelled();
        let mut budget = self.config.max_num_batched_tokens;
        // (index into `running`, tokens to run this step)
        let mut scheduled: Vec<(usize, usize)> = Vec::new();
        let policy = self.config.policy;
        // The first waiting sequence a running prompt chunk yields to.
        let mut next_waiting = None;
        if policy.reorders() {
            let now = Instant::now();
            self.running
                .sort_by_cached_key(|seq| policy.running(seq, now));
            self.waiting
                .make_contiguous()
                .sort_by_cached_key(|seq| policy.waiting(seq, now));
            if self.running.len() < self.config.max_num_seqs {
                next_waiting = self.waiting.front().map(|seq| policy.waiting(seq, now));
            }
        }
        let running = self.running.len();
        let pass =
            self.schedule_running(0..running, &mut budget, &mut scheduled, next_waiting, true);
        // Admitting while preempting would only churn blocks.
        if !pass.preempted {
            let before = pass.yielded_at.map(|i| {
                let now = Instant::now();
                policy.running(&self.running[i], now)
            });
            self.admit(&mut budget, &mut scheduled, before);
        }
        if let Some(i) = pass.yielded_at {
            // What admission left, for the sequences that yielded. Admitted ones sit past
            // them, already scheduled, and must keep their indices: preempting is only
            // safe when nothing was admitted — and then needed, or a sequence short of
            // blocks would wait forever behind a waiting one that cannot be admitted.
            let may_preempt = self.running.len() == running;
            self.schedule_running(i..running, &mut budget, &mut scheduled, None, may_preempt);
        }

        if !scheduled.is_empty() {
            self.run_batch(&scheduled);
        }
        self.update_gauges();
        !scheduled.is_empty()
    }

    /// Gives the running sequences at `indices` their next tokens within `budget`.
    /// Stops at a sequence with more work than `yield_to` (a waiting sequence's priority)
    /// so that one is admitted first; preempts the last running sequences when blocks run
    /// out if `may_preempt`, else stops there.
    fn schedule_running(
        &mut self,
        indices: std::ops::Range<usize>,
        budget: &mut usize,
        scheduled: &mut Vec<(usize, usize)>,
        yield_to: Option<Priority>,
        may_preempt: bool,
    ) -> RunningPass {
        let mut pass = RunningPass::default();
        let now = Instant::now();
        let mut end = indices.end;
        let mut i = indices.start;
        while i < end && *budget > 0 {
            let seq = &self.running[i];
            if !pass.preempted && yield_to.is_some_and(|w| w < self.config.policy.running(seq, now))
            {
                pass.yielded_at = Some(i);
                return pass;
            }
            let num_new = seq.num_uncomputed().min(*budget);
            let missing = seq.blocks_missing(seq.num_computed + num_new);
            if self.blocks.num_free() < missing {
                if !may_preempt {
                    break;
                }
                // Preempt the last sequence in order (possibly this one).
                end -= 1;
                self.preempt(end);
                pass.preempted = true;
                continue;
            }
            let new_blocks = self.blocks.allocate(missing).unwrap_or_default();
            self.running[i].blocks.extend(new_blocks);
            scheduled.push((i, num_new));
            *budget -= num_new;
            i += 1;
        }
        pass
    }

    /// Admits waiting sequences (prefix-cache lookup first) while budget, batch slots and
    /// blocks allow; under a reordering policy only those that go before `before`.
    fn admit(
        &mut self,
        budget: &mut usize,
        scheduled: &mut Vec<(usize, usize)>,
        before: Option<Priority>,
    ) {
        let policy = self.config.policy;
        let now = Instant::now();
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if before.is_some_and(|b| policy.waiting(&seq, now) >= b) {
                self.waiting.push_front(seq);
                break;
            }
            // Imported KV replaces the prefix-cache lookup.
            let (imported, reused) = seq.kv_import().map_or((0, Default::default()), |i| {
                (i.num_tokens, i.reused.within(i.num_tokens))
            });
            // A scored prompt is computed whole: cached blocks have no logits (as vLLM).
            let hit = if imported > 0 || seq.scores_prompt() {
                PrefixHit::default()
            } else {
                self.blocks.match_prefix(&seq.tokens)
            };
            let start = hit.num_tokens() + imported;
            let num_new = (seq.tokens.len() - start).min(*budget);
            let missing = (start + num_new).div_ceil(BLOCK_SIZE) - hit.blocks.len();
            let Some(new_blocks) = self.blocks.allocate(missing) else {
                if let Err(e) = self.blocks.release(&hit.blocks) {
                    tracing::error!("releasing prefix-cache hits failed: {e}");
                }
                self.waiting.push_front(seq);
                break;
            };
            if let Some(import) = seq.take_kv_import() {
                if let Err(e) = self.write_imported(&new_blocks, &import.blocks) {
                    if let Err(e) = self.blocks.release(&new_blocks) {
                        tracing::error!("releasing blocks of a failed import failed: {e}");
                    }
                    self.release_queue_slot(&mut seq);
                    self.metrics.finished("error");
                    // Gauges before the event, as for a finished sequence.
                    self.update_gauges();
                    seq.send(SeqEvent::Failed(format!(
                        "cannot load the imported KV: {e}"
                    )));
                    continue;
                }
            }
            if seq.cached_tokens.is_none() {
                if let Some(trace) = seq.trace() {
                    trace.admitted();
                }
                self.metrics
                    .queue_seconds
                    .observe(seq.arrived.elapsed().as_secs_f64());
                // `cached_tokens`: prompt tokens nobody computed for this request. Imported
                // KV counts only where its source had not computed it either (its prefix-
                // cache hits, an earlier turn's KV); KV the prefill worker computed for
                // this very request is reported apart, as imported.
                let cached = if imported > 0 {
                    reused
                } else {
                    ReusedTokens {
                        prefix_cache_tokens: hit.num_tokens(),
                        earlier_turn_tokens: 0,
                    }
                };
                seq.cached_tokens = Some(cached.total());
                seq.earlier_turn_tokens = cached.earlier_turn_tokens;
                seq.kv_imported_tokens = imported;
                seq.send(SeqEvent::Admitted {
                    cached_tokens: cached.total(),
                    earlier_turn_tokens: cached.earlier_turn_tokens,
                    kv_imported_tokens: imported,
                });
                self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
                self.metrics
                    .prefix_cache_queries
                    .inc_by(seq.prompt_len as u64);
                self.metrics
                    .prefix_cache_hits
                    .inc_by(hit.num_tokens() as u64);
            }
            seq.num_computed = start;
            seq.blocks = hit.blocks;
            seq.blocks.extend(new_blocks);
            seq.hashes = hit.hashes;
            if let Err(e) = seq.commit_full_blocks(&mut self.blocks) {
                tracing::error!("prefix-cache commit failed: {e}");
            }
            self.release_queue_slot(&mut seq);
            self.running.push(seq);
            scheduled.push((self.running.len() - 1, num_new));
            *budget -= num_new;
        }
    }

    fn write_imported(&mut self, ids: &[BlockId], blocks: &[Vec<u8>]) -> Result<(), ModelError> {
        for (&id, bytes) in ids.iter().zip(blocks) {
            self.model.write_block(id, bytes)?;
        }
        Ok(())
    }

    /// Pins the blocks holding a finishing sequence's computed tokens, for a peer to read.
    fn pin_for_export(&mut self, seq: &Sequence) -> Option<PinnedKv> {
        let blocks = seq.blocks[..seq.num_computed.div_ceil(BLOCK_SIZE)].to_vec();
        match self.blocks.pin(&blocks) {
            Ok(()) => Some(PinnedKv {
                blocks,
                num_tokens: seq.num_computed,
                tokens: seq.tokens[..seq.num_computed].to_vec(),
                reused: seq.reused(),
            }),
            Err(e) => {
                tracing::error!("pinning a finished sequence's blocks failed: {e}");
                None
            }
        }
    }

    fn run_batch(&mut self, scheduled: &[(usize, usize)]) {
        let started = Instant::now();
        let profiled = self
            .profiler
            .is_recording()
            .then(|| token_split(scheduled, &self.running));
        let all_rows: Vec<bool> = scheduled
            .iter()
            .map(|&(i, _)| self.running[i].needs_all_rows())
            .collect();
        let steps: Vec<SequenceStep<'_>> = scheduled
            .iter()
            .map(|&(i, n)| {
                let seq = &self.running[i];
                SequenceStep {
                    tokens: &seq.tokens[seq.num_computed..seq.num_computed + n],
                    start_pos: seq.num_computed,
                    block_table: &seq.blocks,
                }
            })
            .collect();
        // A panicking forward (a bug in the model code) fails this batch, not the worker.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.model.forward(&steps, &all_rows)
        }))
        .unwrap_or_else(|_| Err(ModelError::Other("the forward pass panicked".into())));
        drop(steps);
        let forward = started.elapsed();

        let mut finished = Vec::new();
        match result {
            Ok(logits) if logits.len() == scheduled.len() => {
                for ((&(i, n), logits), &all) in scheduled.iter().zip(&logits).zip(&all_rows) {
                    let seq = &mut self.running[i];
                    let start = seq.num_computed;
                    let logits = if all {
                        seq.score_prompt_rows(logits, start, n)
                    } else {
                        &logits[..]
                    };
                    seq.num_computed += n;
                    if let Err(e) = seq.commit_full_blocks(&mut self.blocks) {
                        tracing::error!("prefix-cache commit failed: {e}");
                    }
                    if seq.num_uncomputed() > 0 {
                        continue; // more prompt chunks to go
                    }
                    seq.send_prompt_logprobs();
                    if seq.generates_nothing() {
                        let elapsed = seq.arrived.elapsed().as_secs_f64();
                        self.metrics.request_seconds.observe(elapsed);
                        self.metrics.vllm.e2e_request_latency.observe(elapsed);
                        let reason = FinishReason::Length;
                        finished.push((
                            i,
                            SeqEvent::Finished {
                                reason,
                                usage: seq.usage(),
                                pinned: None,
                            },
                        ));
                        self.metrics.finished(reason.as_str());
                        continue;
                    }
                    let reason = seq.append_sampled(logits, self.config.max_model_len);
                    self.metrics.generation_tokens.inc();
                    let elapsed = seq.arrived.elapsed().as_secs_f64();
                    if seq.num_generated() == 1 {
                        if let Some(trace) = seq.trace() {
                            trace.first_token();
                        }
                        self.metrics.time_to_first_token_seconds.observe(elapsed);
                        self.metrics.vllm.time_to_first_token.observe(elapsed);
                    }
                    if let Some(gap) = seq.token_gap() {
                        let gap = gap.as_secs_f64();
                        self.metrics.vllm.inter_token_latency.observe(gap);
                    }
                    if reason.is_some() {
                        self.metrics.request_seconds.observe(elapsed);
                        self.metrics.vllm.e2e_request_latency.observe(elapsed);
                    }
                    if let Some(reason) = reason {
                        finished.push((
                            i,
                            SeqEvent::Finished {
                                reason,
                                usage: seq.usage(),
                                pinned: None,
                            },
                        ));
                        self.metrics.finished(reason.as_str());
                    }
                }
            }
            Ok(logits) => {
                let msg = format!(
                    "the model returned {} logit rows for {} sequences",
                    logits.len(),
                    scheduled.len()
                );
                self.fail_all(scheduled, &msg, &mut finished);
            }
            Err(e) => self.fail_all(
                scheduled,
                &format!("forward pass failed: {e}"),
                &mut finished,
            ),
        }
        // Remove from the back so earlier indices stay valid.
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        let mut done = Vec::with_capacity(finished.len());
        for (i, mut event) in finished {
            let mut seq = self.running.remove(i);
            if let Some(trace) = seq.trace() {
                trace.finished();
            }
            if let SeqEvent::Finished { pinned, .. } = &mut event {
                if seq.pin_on_finish() {
                    *pinned = self.pin_for_export(&seq);
                }
            }
            self.retire(&mut seq);
            done.push((seq, event));
        }
        // Gauges first: a client that has its answer and then scrapes /metrics must not
        // still see its sequence running or its blocks in use.
        if !done.is_empty() {
            self.update_gauges();
        }
        for (seq, event) in done {
            if let SeqEvent::Finished {
                pinned: Some(pinned),
                ..
            } = &event
            {
                let blocks = pinned.blocks.clone();
                if !seq.send(event) {
                    // The requester is gone: nobody will ever publish these blocks.
                    if let Err(e) = self.blocks.unpin(&blocks) {
                        tracing::error!("unpinning an unclaimed export failed: {e}");
                    }
                }
            } else {
                seq.send(event);
            }
        }

        let batch = scheduled.len();
        if let Some((prefill_tokens, decode_tokens)) = profiled {
            self.profiler.record(StepSpan {
                start: started,
                forward,
                sampling: started.elapsed().saturating_sub(forward),
                batch_size: batch,
                prefill_tokens,
                decode_tokens,
            });
        }
        self.metrics
            .step_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.batch_size.observe(batch as f64);
        if batch as i64 > self.metrics.batch_size_max.get() {
            self.metrics.batch_size_max.set(batch as i64);
        }
    }

    fn fail_all(&self, scheduled: &[(usize, usize)], msg: &str, out: &mut Vec<(usize, SeqEvent)>) {
        tracing::error!("{msg}");
        for &(i, _) in scheduled {
            out.push((i, SeqEvent::Failed(msg.to_string())));
            self.metrics.finished("error");
        }
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as i64);
        m.waiting.set(self.waiting.len() as i64);
        m.kv_blocks_used.set(self.blocks.num_used() as i64);
        m.kv_blocks_free.set(self.blocks.num_free() as i64);
        m.kv_blocks_cached.set(self.blocks.num_cached() as i64);
        m.kv_blocks_pinned.set(self.blocks.num_pinned() as i64);
        // Counted by the block manager as it reclaims; mirrored here.
        let reclaimed = self.blocks.kept_reclaimed();
        let counted = m.kv.handback_reclaimed_blocks.get();
        if reclaimed > counted {
            m.kv.handback_reclaimed_blocks.inc_by(reclaimed - counted);
        }
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
