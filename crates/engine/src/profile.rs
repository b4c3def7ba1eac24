//! The scheduler's step profiler behind `POST /start_profile` and `POST /stop_profile`
//! (enabled by `--profile-dir`): while it records, every scheduler step leaves a span
//! (batch size, prefill and decode tokens, forward and sampling time); stopping writes
//! them as a Chrome trace (`chrome://tracing`, Perfetto) into the directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::sequence::Sequence;
use crate::step_shape::StepShape;

/// Most steps one recording keeps (about 50 MB); later steps are counted, not kept.
const MAX_STEPS: usize = 1 << 20;

/// One scheduler step.
#[derive(Debug, Clone, Copy)]
pub struct StepSpan {
    /// When the step's forward pass began.
    pub start: Instant,
    /// The batched forward pass.
    pub forward: Duration,
    /// Sampling, streaming the tokens out and retiring finished sequences.
    pub sampling: Duration,
    /// Sequences in the batch.
    pub batch_size: usize,
    /// What the forward pass computed.
    pub shape: StepShape,
}

/// Why a profiler call failed.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The worker was started without `--profile-dir`.
    #[error("profiling is off: start the worker with --profile-dir DIR")]
    Disabled,
    /// `stop` without a `start`.
    #[error("the profiler is not running: POST /start_profile first")]
    NotRunning,
    /// The trace could not be written.
    #[error("cannot write the trace {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A written trace.
#[derive(Debug, Clone)]
pub struct TraceFile {
    /// Where it is.
    pub path: PathBuf,
    /// Steps in it.
    pub steps: usize,
    /// Steps recorded past the cap and left out.
    pub dropped: u64,
}

#[derive(Debug)]
struct Recording {
    started: Instant,
    started_unix: Duration,
    steps: Vec<StepSpan>,
    dropped: u64,
}

/// The profiler one scheduler shares with the HTTP layer; idle (one relaxed atomic load
/// per step) unless recording.
#[derive(Debug, Default)]
pub struct Profiler {
    dir: OnceLock<PathBuf>,
    recording: AtomicBool,
    session: Mutex<Option<Recording>>,
}

impl Profiler {
    /// Turns profiling on, writing traces into `dir` (the first call wins).
    pub fn enable(&self, dir: PathBuf) {
        let _ = self.dir.set(dir);
    }

    /// Where traces go, when profiling is on.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.get().map(PathBuf::as_path)
    }

    /// Whether steps are being recorded.
    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Option<Recording>> {
        // A panic while pushing a span cannot leave the recording torn in a way that matters.
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts recording; `false` when it already was (the recording goes on).
    pub fn start(&self) -> Result<bool, ProfileError> {
        if self.dir().is_none() {
            return Err(ProfileError::Disabled);
        }
        let mut session = self.lock();
        if session.is_some() {
            return Ok(false);
        }
        *session = Some(Recording {
            started: Instant::now(),
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
            steps: Vec::new(),
            dropped: 0,
        });
        self.recording.store(true, Ordering::Relaxed);
        Ok(true)
    }

    /// Records one step (called by the scheduler while recording).
    pub fn record(&self, span: StepSpan) {
        if let Some(session) = self.lock().as_mut() {
            if session.steps.len() < MAX_STEPS {
                session.steps.push(span);
            } else {
                session.dropped += 1;
            }
        }
    }

    /// Stops recording and writes the Chrome trace (blocking file I/O).
    pub fn stop(&self) -> Result<TraceFile, ProfileError> {
        let dir = self.dir().ok_or(ProfileError::Disabled)?.to_path_buf();
        let recording = {
            let mut session = self.lock();
            self.recording.store(false, Ordering::Relaxed);
            session.take().ok_or(ProfileError::NotRunning)?
        };
        let path = dir.join(format!(
            "pdserve-trace-{}-{}.json",
            std::process::id(),
            recording.started_unix.as_millis()
        ));
        let io = |source| ProfileError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let file = std::fs::File::create(&path).map_err(io)?;
        let mut out = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut out, &chrome_trace(&recording))
            .map_err(|e| io(std::io::Error::other(e)))?;
        out.flush().map_err(io)?;
        Ok(TraceFile {
            steps: recording.steps.len(),
            dropped: recording.dropped,
            path,
        })
    }
}

/// What a step computes: a sequence running only its last token decodes; anything else
/// computes prompt (or recomputes after preemption).
pub(crate) fn step_shape(scheduled: &[(usize, usize)], running: &[Sequence]) -> StepShape {
    let mut shape = StepShape::default();
    for &(i, n) in scheduled {
        let seq = &running[i];
        let decodes = n == 1
            && seq.num_computed + 1 == seq.tokens.len()
            && seq.num_computed >= seq.prompt_len;
        shape.add(seq.num_computed, n, decodes);
    }
    shape
}

/// The recording in the Chrome trace event format: a `step` span per step with `forward`
/// and `sample` inside it, and a counter track of batch composition.
fn chrome_trace(recording: &Recording) -> Value {
    let pid = std::process::id();
    let us = |d: Duration| (d.as_secs_f64() * 1e6 * 1e3).round() / 1e3;
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": pid, "tid": 1,
               "args": {"name": "pdserve worker"}}),
        json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1,
               "args": {"name": "scheduler"}}),
    ];
    for step in &recording.steps {
        let ts = us(step.start.saturating_duration_since(recording.started));
        let forward = us(step.forward);
        let sampling = us(step.sampling);
        events.push(json!({
            "name": "step", "cat": "scheduler", "ph": "X", "pid": pid, "tid": 1,
            "ts": ts, "dur": us(step.forward + step.sampling),
            "args": {
                "batch_size": step.batch_size,
                "prefill_tokens": step.shape.prefill_tokens,
                "decode_tokens": step.shape.decode_seqs,
                "prefill_attention_pairs": step.shape.prefill_attention_pairs,
                "decode_context_tokens": step.shape.decode_context_tokens,
                "forward_us": forward,
                "sampling_us": sampling,
            },
        }));
        events.push(
            json!({"name": "forward", "cat": "model", "ph": "X", "pid": pid,
                           "tid": 1, "ts": ts, "dur": forward}),
        );
        events.push(
            json!({"name": "sample", "cat": "sampling", "ph": "X", "pid": pid,
                           "tid": 1, "ts": ts + forward, "dur": sampling}),
        );
        events.push(
            json!({"name": "batch", "ph": "C", "pid": pid, "tid": 1, "ts": ts,
                           "args": {"prefill_tokens": step.shape.prefill_tokens,
                                    "decode_tokens": step.shape.decode_seqs}}),
        );
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "pdserve",
            "started_unix_ms": recording.started_unix.as_millis() as u64,
            "steps": recording.steps.len(),
            "dropped_steps": recording.dropped,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::request::{GenerationRequest, SeqEvent};
    use crate::scheduler::{spawn, SchedulerConfig};
    use crate::step_model::fake::FakeModel;
    use std::sync::Arc;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "pdserve-profile-{name}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn off_without_a_directory_and_stop_needs_a_start() {
        let profiler = Profiler::default();
        assert!(matches!(profiler.start(), Err(ProfileError::Disabled)));
        assert!(matches!(profiler.stop(), Err(ProfileError::Disabled)));
        profiler.enable(temp_dir("rules"));
        assert!(matches!(profiler.stop(), Err(ProfileError::NotRunning)));
        assert!(profiler.start().unwrap());
        assert!(!profiler.start().unwrap(), "already recording");
        assert!(profiler.is_recording());
        let trace = profiler.stop().unwrap();
        assert!(!profiler.is_recording());
        assert_eq!(trace.steps, 0);
        std::fs::remove_dir_all(profiler.dir().unwrap()).unwrap();
    }

    #[test]
    fn the_scheduler_records_steps_into_a_chrome_trace() {
        let config = SchedulerConfig {
            policy: crate::scheduler::SchedulingPolicy::Fcfs,
            max_num_seqs: 4,
            max_waiting: 16,
            max_num_batched_tokens: 8,
            max_model_len: 256,
        };
        let (engine, thread) = spawn(FakeModel::new(32), config, Arc::new(Metrics::new())).unwrap();
        let dir = temp_dir("trace");
        engine.profiler().enable(dir.clone());
        engine.profiler().start().unwrap();
        // A 20-token prompt in chunks of 8 (prefill steps), then 4 decode steps.
        let mut events = engine
            .submit(GenerationRequest::new((1..=20).collect(), 5))
            .unwrap();
        loop {
            match events.blocking_recv() {
                Some(SeqEvent::Finished { .. }) => break,
                Some(SeqEvent::Failed(e)) => panic!("{e}"),
                Some(_) => {}
                None => panic!("events closed"),
            }
        }
        // The last step is recorded after its tokens go out: let the scheduler finish
        // before reading the trace.
        engine.shutdown();
        thread.join().unwrap();
        let trace = engine.profiler().stop().unwrap();

        let text = std::fs::read_to_string(&trace.path).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        let events = json["traceEvents"].as_array().unwrap();
        let steps: Vec<&Value> = events.iter().filter(|e| e["name"] == "step").collect();
        assert_eq!(steps.len(), trace.steps);
        assert!(steps.len() >= 7, "{} steps", steps.len());
        let total = |key: &str| {
            steps
                .iter()
                .map(|s| s["args"][key].as_u64().unwrap())
                .sum::<u64>()
        };
        assert_eq!(total("prefill_tokens"), 20);
        assert_eq!(total("decode_tokens"), 4);
        for step in &steps {
            assert_eq!(
                (step["ph"].clone(), step["args"]["batch_size"].clone()),
                (json!("X"), json!(1))
            );
            assert!(step["dur"].as_f64().unwrap() >= step["args"]["forward_us"].as_f64().unwrap());
        }
        assert_eq!(
            events.iter().filter(|e| e["name"] == "forward").count(),
            steps.len()
        );
        assert_eq!(json["displayTimeUnit"], "ms");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
