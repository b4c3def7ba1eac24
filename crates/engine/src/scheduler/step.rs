//! One scheduling step: give every running sequence its next tokens within the token
//! budget (preempting the most recently admitted when KV blocks run out), admit waiting
//! sequences (prefix-cache lookup or imported KV first), then run the batch.

use std::time::Instant;

use pdserve_kv_transfer::ReusedTokens;
use pdserve_model::{BlockId, ModelError, BLOCK_SIZE};

use super::thread::Scheduler;
use crate::block_manager::PrefixHit;
use crate::request::SeqEvent;
use crate::scheduling::Priority;
use crate::step_model::StepModel;

/// How far one pass over the running batch got.
#[derive(Debug, Default)]
struct RunningPass {
    /// Sequences were preempted for blocks (no admission this step).
    preempted: bool,
    /// The pass stopped here so that a waiting sequence with less work goes first.
    yielded_at: Option<usize>,
}

impl<M: StepModel> Scheduler<M> {
    /// One scheduling step; false when nothing could run.
    pub(super) fn step(&mut self) -> bool {
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
            let (imported, reused) = seq.kv_import().map_or((0, Default::default()), |i| {
                (i.num_tokens, i.reused.within(i.num_tokens))
            });
            // A scored prompt is computed whole: cached blocks have no logits (as vLLM).
            // Imported KV is written only past what this worker's own prefix cache holds
            // of it: an import of a prompt sharing a cached prefix takes blocks for its
            // new part only, and leaves the other cached prefixes in place.
            let hit = if seq.scores_prompt() {
                PrefixHit::default()
            } else if imported > 0 {
                // Submission checked that a token past the import is left to compute.
                self.blocks.match_prefix(&seq.tokens[..=imported])
            } else {
                self.blocks.match_prefix(&seq.tokens)
            };
            let start = if imported > 0 {
                imported
            } else {
                hit.num_tokens()
            };
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
                let written = self.write_imported(&new_blocks, &import.blocks[hit.blocks.len()..]);
                if let (Ok(()), Some(landed)) = (&written, import.landed_at) {
                    // Its first forward runs in this very step.
                    let wait = landed.elapsed().as_secs_f64();
                    self.metrics.kv.import_wait_seconds.observe(wait);
                }
                if let Err(e) = written {
                    let taken = [hit.blocks.as_slice(), &new_blocks].concat();
                    if let Err(e) = self.blocks.release(&taken) {
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
                if let Some(feed) = seq.kv_feed() {
                    feed.admitted(cached);
                }
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
            if let Some(feed) = seq.kv_feed() {
                // Cached and imported blocks are computed already.
                feed.offer(seq.num_computed, |b| self.model.read_block(seq.blocks[b]));
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
}
