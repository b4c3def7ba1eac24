//! The handle the rest of the worker holds on the scheduler thread: requests in, KV
//! block commands (reads, pins, keeps) queued in order between steps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use pdserve_model::BlockId;
use tokio::sync::{mpsc, oneshot};

use super::error::{KvError, SubmitError};
use crate::heartbeat::{Heartbeat, SchedulerCondition};
use crate::profile::Profiler;
use crate::request::{GenerationRequest, SeqEvent, SeqEvents};

/// Where a KV command's answer goes.
type Reply<T> = oneshot::Sender<Result<T, KvError>>;

/// What the scheduler thread is asked to do, in the order asked.
pub(super) enum Command {
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
    pub(super) commands: std_mpsc::Sender<Command>,
    /// Requests accepted but never admitted to the running batch yet.
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) max_waiting: usize,
    /// Whether a request's `priority` is honoured.
    pub(super) honours_priority: bool,
    pub(super) heartbeat: Arc<Heartbeat>,
    pub(super) profiler: Arc<Profiler>,
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
        if let Some(id) = request.first_token {
            // Reported now, not when the scheduler thread next looks at its queue (after
            // the step it may be in the middle of).
            let _ = tx.send(SeqEvent::Token { id, logprobs: None });
        }
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
