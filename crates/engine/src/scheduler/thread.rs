//! The scheduler thread: its state, its loop, the commands it serves between steps, and
//! the bookkeeping every step shares (retiring, preempting, the gauges).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use pdserve_model::{BlockId, BLOCK_SIZE};

use super::config::SchedulerConfig;
use super::error::KvError;
use super::handle::Command;
use crate::block_manager::BlockManager;
use crate::heartbeat::Heartbeat;
use crate::kv_events::{CacheNews, EventSink};
use crate::metrics::Metrics;
use crate::profile::Profiler;
use crate::request::SeqEvent;
use crate::sequence::Sequence;
use crate::step_model::StepModel;

/// How often a stalled scheduler (work waiting, no block free) looks again.
const STALL_POLL: Duration = Duration::from_millis(5);
/// How often an idle scheduler beats its heartbeat: the beat must stay fresh while idle
/// so that a request arriving after a long idle spell never looks like a wedge.
const IDLE_BEAT: Duration = Duration::from_secs(1);

/// The scheduler thread's state: the model, the KV pool and the sequences.
pub(super) struct Scheduler<M> {
    pub(super) model: M,
    pub(super) blocks: BlockManager,
    /// Where prefix-cache changes go (`--kv-events-config`).
    pub(super) events: Option<EventSink>,
    pub(super) config: SchedulerConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) waiting: VecDeque<Sequence>,
    pub(super) running: Vec<Sequence>,
    pub(super) stopping: bool,
    pub(super) heartbeat: Arc<Heartbeat>,
    pub(super) profiler: Arc<Profiler>,
}

impl<M: StepModel> Scheduler<M> {
    pub(super) fn run(mut self, commands: std_mpsc::Receiver<Command>) {
        let mut stalled = false;
        loop {
            self.heartbeat.beat(self.has_work());
            if !self.has_work() {
                // Idle: wait for work (or for every handle to go).
                self.model.idle();
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
            if stalled {
                self.model.idle();
            }
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

    pub(super) fn read_pinned(&self, ids: &[BlockId]) -> Result<Vec<Vec<u8>>, KvError> {
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
        if seq.has_given_first_token() && (seq.scores_prompt() || seq.ends_at_given_token()) {
            return Err(
                "a given first token needs max_tokens above 1, no prompt logprobs, \
                        and must not be a stop token"
                    .into(),
            );
        }
        if let Some(import) = seq.kv_import() {
            if seq.scores_prompt() {
                return Err("prompt logprobs need the whole prompt computed here, \
                            not imported KV"
                    .into());
            }
            // At least one position is left to compute: the last prompt token's, or the
            // given first token's.
            let most = seq.tokens.len() - 1;
            if import.num_tokens == 0
                || import.num_tokens > most
                || import.blocks.len() != import.num_tokens.div_ceil(BLOCK_SIZE)
            {
                return Err(format!(
                    "imported KV must cover 1..={most} prompt tokens in whole blocks; got {} blocks for {} tokens",
                    import.blocks.len(),
                    import.num_tokens
                ));
            }
        }
        if seq.tokens.len() >= self.config.max_model_len {
            return Err(format!(
                "the prompt has {} tokens{}; this worker's limit is {}",
                seq.prompt_len,
                if seq.has_given_first_token() {
                    " and a given first token"
                } else {
                    ""
                },
                self.config.max_model_len.saturating_sub(1)
            ));
        }
        Ok(())
    }

    pub(super) fn release_queue_slot(&self, seq: &mut Sequence) {
        if std::mem::take(&mut seq.holds_queue_slot) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Frees the sequence's blocks and queue slot. Block errors are bugs; they are logged
    /// rather than allowed to take the worker down.
    pub(super) fn retire(&mut self, seq: &mut Sequence) {
        if let Err(e) = seq.release_blocks(&mut self.blocks) {
            tracing::error!("releasing a sequence's blocks failed: {e}");
        }
        self.release_queue_slot(seq);
    }

    pub(super) fn reap_cancelled(&mut self) {
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
    pub(super) fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        if let Err(e) = seq.release_blocks(&mut self.blocks) {
            tracing::error!("releasing a preempted sequence's blocks failed: {e}");
        }
        self.metrics.preemptions.inc();
        tracing::debug!(tokens = seq.tokens.len(), "preempted a sequence");
        self.waiting.push_front(seq);
    }

    pub(super) fn update_gauges(&self) {
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
