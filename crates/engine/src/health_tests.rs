//! Health over a real scheduler thread driven by fake models that can be made to hang
//! in a step or to panic outside one.

use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use pdserve_model::{BlockId, ModelError, SequenceStep};

use super::*;
use crate::metrics::Metrics;
use crate::request::{GenerationRequest, SeqEvent};
use crate::scheduler::{spawn, KvError, SchedulerConfig};
use crate::step_model::fake::FakeModel;
use crate::step_model::{StepModel, StepOutput};

const DEADLINE: Duration = Duration::from_secs(20);
/// Short enough for tests, long enough that no healthy fake step comes near it.
const WEDGED_AFTER: Duration = Duration::from_millis(150);

/// The fake model, except that each forward step first announces itself on `entered`
/// and then waits for a message (or hang-up) on `release`; and reading a block panics.
struct Gated {
    inner: FakeModel,
    entered: std_mpsc::Sender<()>,
    release: std_mpsc::Receiver<()>,
}

impl StepModel for Gated {
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    fn forward(
        &mut self,
        batch: &[SequenceStep<'_>],
        all_rows: &[bool],
    ) -> Result<Vec<StepOutput>, ModelError> {
        let _ = self.entered.send(());
        let _ = self.release.recv();
        self.inner.forward(batch, all_rows)
    }

    fn read_block(&self, _id: BlockId) -> Vec<u8> {
        panic!("injected failure: reading a KV block");
    }

    fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        self.inner.write_block(id, bytes)
    }
}

struct Harness {
    engine: EngineHandle,
    thread: JoinHandle<()>,
    entered: std_mpsc::Receiver<()>,
    release: std_mpsc::Sender<()>,
}

fn start() -> Harness {
    let (entered_tx, entered) = std_mpsc::channel();
    let (release, release_rx) = std_mpsc::channel();
    let model = Gated {
        inner: FakeModel::new(16),
        entered: entered_tx,
        release: release_rx,
    };
    let config = SchedulerConfig {
        policy: crate::scheduler::SchedulingPolicy::Fcfs,
        max_num_seqs: 4,
        max_waiting: 8,
        max_num_batched_tokens: 256,
        max_model_len: 256,
    };
    let (engine, thread) = spawn(model, config, Arc::new(Metrics::new())).unwrap();
    Harness {
        engine,
        thread,
        entered,
        release,
    }
}

/// Polls `health` until it reports `want`.
fn wait_for(health: &WorkerHealth, want: impl Fn(&Result<(), Unhealthy>) -> bool) {
    let start = Instant::now();
    loop {
        let now = health.check();
        if want(&now) {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "health stuck at {now:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_idle_scheduler_stays_healthy_however_long_it_waits() {
    let h = start();
    let health = WorkerHealth::new(h.engine.clone(), WEDGED_AFTER);
    // Several wedge bounds without a step: no work, so no wedge.
    std::thread::sleep(WEDGED_AFTER * 4);
    assert_eq!(health.check(), Ok(()));
    h.engine.shutdown();
    h.thread.join().unwrap();
}

#[test]
fn a_step_that_does_not_end_is_a_wedge_until_it_ends() {
    let h = start();
    let health = WorkerHealth::new(h.engine.clone(), WEDGED_AFTER);
    let mut events = h
        .engine
        .submit(GenerationRequest::new(vec![1, 2, 3], 1))
        .unwrap();
    h.entered.recv_timeout(DEADLINE).expect("the step started");
    assert_eq!(
        health.check(),
        Ok(()),
        "a step is not a wedge before the bound"
    );
    wait_for(
        &health,
        |h| matches!(h, Err(Unhealthy::SchedulerWedged(silent)) if *silent > WEDGED_AFTER),
    );
    assert_eq!(
        health.check().unwrap_err().reason(),
        "scheduler_wedged",
        "stays wedged while the step hangs"
    );
    h.release.send(()).unwrap();
    wait_for(&health, Result::is_ok);
    loop {
        match events.blocking_recv() {
            Some(SeqEvent::Finished { .. }) => break,
            Some(SeqEvent::Admitted { .. } | SeqEvent::Token { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    h.engine.shutdown();
    h.thread.join().unwrap();
}

#[test]
fn a_dead_scheduler_thread_is_reported() {
    let h = start();
    let health = WorkerHealth::new(h.engine.clone(), Duration::from_secs(3600));
    let mut request = GenerationRequest::new(vec![1, 2, 3], 1);
    request.pin_on_finish = true;
    let mut events = h.engine.submit(request).unwrap();
    h.entered.recv_timeout(DEADLINE).unwrap();
    h.release.send(()).unwrap();
    let pinned = loop {
        match events.blocking_recv() {
            Some(SeqEvent::Finished {
                pinned: Some(p), ..
            }) => break p,
            Some(SeqEvent::Admitted { .. } | SeqEvent::Token { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(health.check(), Ok(()));
    // The read panics on the scheduler thread, outside the forward pass's guard.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let read = rt.block_on(h.engine.read_blocks(pinned.blocks));
    assert_eq!(read, Err(KvError::Stopped));
    assert!(h.thread.join().is_err(), "the thread panicked");
    assert_eq!(health.check(), Err(Unhealthy::SchedulerExited));
    assert_eq!(
        h.engine.condition(Duration::from_secs(3600)),
        SchedulerCondition::Exited
    );
}

#[test]
fn draining_is_unhealthy_and_a_stopped_scheduler_more_so() {
    let h = start();
    let health = WorkerHealth::new(h.engine.clone(), WEDGED_AFTER);
    assert_eq!(health.check(), Ok(()));
    health.begin_drain();
    assert_eq!(health.check(), Err(Unhealthy::Draining));
    assert_eq!(health.check().unwrap_err().reason(), "draining");
    h.engine.shutdown();
    h.thread.join().unwrap();
    assert_eq!(health.check(), Err(Unhealthy::SchedulerExited));
}
