//! Continuous batching on a dedicated OS thread.
//!
//! Each step: drop cancelled sequences; give every running sequence its next tokens (one
//! decode token, or the next chunk of its prompt) within a token budget, preempting the
//! most recently admitted sequences when KV blocks run out; admit waiting sequences
//! (prefix-cache lookup first) while budget, batch slots and blocks allow; run ONE batched
//! forward; sample, stream tokens out, and retire finished sequences.

mod batch;
mod config;
mod error;
mod handle;
mod step;
mod thread;

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;

use pdserve_model::BLOCK_SIZE;

pub use self::config::SchedulerConfig;
pub use self::error::{KvError, SubmitError};
pub use self::handle::EngineHandle;
use self::thread::Scheduler;
use crate::block_manager::BlockManager;
use crate::heartbeat::Heartbeat;
use crate::kv_events::{CacheNews, EventSink};
use crate::metrics::Metrics;
use crate::profile::Profiler;
pub use crate::scheduling::SchedulingPolicy;
use crate::step_model::StepModel;

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
            // The forward pass's caller computes beside the pool: on the worker's own
            // cores, never on borrowed ones at its full priority.
            pdserve_model::pin_to_own_cores();
            scheduler.run(rx)
        })?;
    Ok((handle, thread))
}

#[cfg(test)]
mod tests;
