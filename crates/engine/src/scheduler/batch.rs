//! Running one batch: the forward pass over the scheduled sequences, sampling, streaming
//! tokens out, and retiring (or pinning for export) the sequences that finished.

use std::time::Instant;

use pdserve_model::{ModelError, SequenceStep, BLOCK_SIZE};

use super::thread::Scheduler;
use crate::metrics::Metrics;
use crate::profile::{step_shape, StepSpan};
use crate::request::{BlockBytes, FinishReason, PinnedKv, SeqEvent};
use crate::sequence::Sequence;
use crate::step_model::{StepModel, StepOutput};

/// A sequence's next token to come: sampled from logits, or chosen by the model.
enum Next<'a> {
    Logits(&'a [f32]),
    Token(u32),
}

impl<M: StepModel> Scheduler<M> {
    /// Pins the blocks holding a finishing sequence's computed tokens, for a peer to read.
    fn pin_for_export(&mut self, seq: &Sequence) -> Option<PinnedKv> {
        let blocks = seq.blocks[..seq.num_computed.div_ceil(BLOCK_SIZE)].to_vec();
        match self.blocks.pin(&blocks) {
            Ok(()) => Some(PinnedKv {
                // Copied now, between steps: a read of them later would wait for the
                // scheduler, which may be in the next prompt's step by then.
                // A streamed reader already got every block from the feed.
                bytes: (seq.copy_on_finish() && !seq.kv_feed().is_some_and(|f| f.has_reader()))
                    .then(|| self.read_pinned(&blocks).ok().map(BlockBytes))
                    .flatten(),
                blocks,
                num_tokens: seq.num_computed,
                tokens: seq.tokens[..seq.num_computed].to_vec(),
                reused: seq.reused(),
                finished_at: Instant::now(),
            }),
            Err(e) => {
                tracing::error!("pinning a finished sequence's blocks failed: {e}");
                None
            }
        }
    }

    pub(super) fn run_batch(&mut self, scheduled: &[(usize, usize)]) {
        let started = Instant::now();
        let profiled = self
            .profiler
            .is_recording()
            .then(|| step_shape(scheduled, &self.running));
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
            Ok(outputs) if outputs.len() == scheduled.len() => {
                for ((&(i, n), output), &all) in scheduled.iter().zip(&outputs).zip(&all_rows) {
                    let seq = &mut self.running[i];
                    let start = seq.num_computed;
                    let next = match output {
                        StepOutput::Logits(logits) if all => {
                            Next::Logits(seq.score_prompt_rows(logits, start, n))
                        }
                        StepOutput::Logits(logits) => Next::Logits(logits),
                        StepOutput::Token(token) => Next::Token(*token),
                    };
                    seq.num_computed += n;
                    if let Err(e) = seq.commit_full_blocks(&mut self.blocks) {
                        tracing::error!("prefix-cache commit failed: {e}");
                    }
                    if let Some(feed) = seq.kv_feed() {
                        // Copied now, while the sequence holds the blocks: a reader
                        // sends them as the next chunk computes.
                        let copy = |b: usize| self.model.read_block(seq.blocks[b]);
                        if seq.num_computed >= seq.prompt_len {
                            feed.complete(copy);
                        } else {
                            feed.offer(seq.num_computed, copy);
                        }
                    }
                    if seq.num_uncomputed() > 0 {
                        continue; // more prompt chunks to go
                    }
                    seq.send_prompt_logprobs();
                    if seq.generates_nothing() {
                        let elapsed = seq.arrived.elapsed().as_secs_f64();
                        let length = FinishReason::Length;
                        record_finish(&self.metrics, &mut finished, i, seq, length, elapsed);
                        continue;
                    }
                    let max_model_len = self.config.max_model_len;
                    let reason = match next {
                        Next::Logits(logits) => seq.append_sampled(logits, max_model_len),
                        Next::Token(token) => seq.append_chosen(token, max_model_len),
                    };
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
                    if let Some(reason) = reason {
                        record_finish(&self.metrics, &mut finished, i, seq, reason, elapsed);
                    }
                }
            }
            Ok(outputs) => {
                let msg = format!(
                    "the model returned {} outputs for {} sequences",
                    outputs.len(),
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
        if let Some(shape) = profiled {
            self.profiler.record(StepSpan {
                start: started,
                forward,
                sampling: started.elapsed().saturating_sub(forward),
                batch_size: batch,
                shape,
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
}

/// Counts `running[i]` as finished for `reason`, `elapsed` seconds after it arrived, and
/// queues its event for when the batch is done (a free function: the caller holds the
/// sequence mutably).
fn record_finish(
    metrics: &Metrics,
    finished: &mut Vec<(usize, SeqEvent)>,
    i: usize,
    seq: &Sequence,
    reason: FinishReason,
    elapsed: f64,
) {
    metrics.request_seconds.observe(elapsed);
    metrics.vllm.e2e_request_latency.observe(elapsed);
    finished.push((
        i,
        SeqEvent::Finished {
            reason,
            usage: seq.usage(),
            pinned: None,
        },
    ));
    metrics.finished(reason.as_str());
}
