//! The simulated forward pass: no model runs; each step takes the time the profile gives
//! for its shape, and each sequence's next token is a function of its whole token
//! history as read back from a paged KV store of its own, so the scheduler, the block
//! manager, the prefix cache and KV transfer are exercised as with the real model: a
//! wrong block table, a stale cached block or a corrupt transfer changes the output.

use std::time::{Duration, Instant};

use pdserve_model::{BlockId, ModelError, SequenceStep, BLOCK_SIZE};
use prometheus_client::metrics::histogram::Histogram;

use super::profile::StepCost;
use crate::step_model::{StepModel, StepOutput};
use crate::step_shape::StepShape;

/// The KV format sim workers exchange (no real worker shares it).
pub const SIM_KV_LAYOUT: &str = "pdserve-sim/v1: 16 x (token u32 le, history hash u64 le)";
/// Bytes of one slot in a block as `read_block` returns it.
const SLOT_BYTES: usize = 12;
/// The history hash before the first token.
const SEED: u64 = 0x9e37_79b9_7f4a_7c15;
/// A logit far enough below the chosen one that no temperature picks anything else.
const UNCHOSEN_LOGIT: f32 = -1e4;

/// One position of the KV store: its token and the hash of the history up to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    token: u32,
    hash: u64,
}

const EMPTY: Slot = Slot {
    token: u32::MAX,
    hash: 0,
};

/// The tokens a simulated engine emits: the vocabulary's upper seven eighths, less the
/// end-of-sequence tokens, so a sequence runs to its `max_tokens` as a trace asks.
#[derive(Debug, Clone)]
pub struct TokenChoice {
    vocab_size: usize,
    candidates: Vec<u32>,
}

impl TokenChoice {
    /// Tokens of a `vocab_size` vocabulary, without `eos`.
    pub fn new(vocab_size: usize, eos: &[u32]) -> Self {
        let candidates = (vocab_size as u32 / 8..vocab_size as u32)
            .filter(|t| !eos.contains(t))
            .collect();
        Self {
            vocab_size,
            candidates,
        }
    }

    fn pick(&self, hash: u64) -> u32 {
        self.candidates[(hash % self.candidates.len() as u64) as usize]
    }
}

/// The step model of `pdserve worker --sim`.
pub struct SimModel {
    slots: Vec<[Slot; BLOCK_SIZE]>,
    cost: StepCost,
    choice: TokenChoice,
    lateness: Histogram,
    /// When the last step was due to end, while steps run back to back.
    last_deadline: Option<Instant>,
}

impl SimModel {
    /// A simulated engine of `num_blocks` KV blocks whose steps cost what `cost` says;
    /// how late each step ends goes into `lateness`.
    pub fn new(
        num_blocks: usize,
        cost: StepCost,
        choice: TokenChoice,
        lateness: Histogram,
    ) -> Self {
        Self {
            slots: vec![[EMPTY; BLOCK_SIZE]; num_blocks],
            cost,
            choice,
            lateness,
            last_deadline: None,
        }
    }

    fn slot(&mut self, table: &[BlockId], pos: usize) -> Result<&mut Slot, ModelError> {
        let block = *table
            .get(pos / BLOCK_SIZE)
            .ok_or_else(|| ModelError::Other("block table too short".into()))?;
        self.slots
            .get_mut(block as usize)
            .map(|b| &mut b[pos % BLOCK_SIZE])
            .ok_or_else(|| ModelError::Other(format!("block {block} is outside the KV pool")))
    }

    /// Writes `seq`'s new tokens with their history hashes; the hash after each one.
    fn run(&mut self, seq: &SequenceStep<'_>) -> Result<Vec<u64>, ModelError> {
        let mut prev = match seq.start_pos {
            0 => SEED,
            pos => {
                let slot = *self.slot(seq.block_table, pos - 1)?;
                if slot == EMPTY {
                    return Err(ModelError::Other(format!(
                        "position {} was never written",
                        pos - 1
                    )));
                }
                slot.hash
            }
        };
        let mut hashes = Vec::with_capacity(seq.tokens.len());
        for (i, &token) in seq.tokens.iter().enumerate() {
            let hash = mix(prev, token);
            *self.slot(seq.block_table, seq.start_pos + i)? = Slot { token, hash };
            hashes.push(hash);
            prev = hash;
        }
        Ok(hashes)
    }

    /// Sleeps until the step that began at `start` is due, and records how late it ended.
    fn finish_step(&mut self, start: Instant, took: Duration) {
        let deadline = start + took;
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
        let late = Instant::now().saturating_duration_since(deadline);
        self.lateness.observe(late.as_secs_f64());
        self.last_deadline = Some(deadline);
    }
}

/// The history hash after `token` follows a history hashed `prev` (splitmix64's
/// finaliser over both).
fn mix(prev: u64, token: u32) -> u64 {
    let mut z = prev ^ (u64::from(token) + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl StepModel for SimModel {
    fn num_blocks(&self) -> usize {
        self.slots.len()
    }

    fn forward(
        &mut self,
        batch: &[SequenceStep<'_>],
        all_rows: &[bool],
    ) -> Result<Vec<StepOutput>, ModelError> {
        // Back to back with the last step, this one starts where that one was due to end:
        // the scheduler's own time between steps is part of a step's modelled time.
        let start = self.last_deadline.unwrap_or_else(Instant::now);
        let mut shape = StepShape::default();
        let mut out = Vec::with_capacity(batch.len());
        for (seq, &all) in batch.iter().zip(all_rows) {
            let n = seq.tokens.len();
            shape.add(seq.start_pos, n, n == 1);
            let hashes = self.run(seq)?;
            out.push(if all {
                let vocab = self.choice.vocab_size;
                let mut logits = vec![UNCHOSEN_LOGIT; n * vocab];
                for (row, &hash) in hashes.iter().enumerate() {
                    logits[row * vocab + self.choice.pick(hash) as usize] = 0.0;
                }
                StepOutput::Logits(logits)
            } else {
                let last = *hashes
                    .last()
                    .ok_or_else(|| ModelError::Other("a sequence with no new tokens".into()))?;
                StepOutput::Token(self.choice.pick(last))
            });
        }
        self.finish_step(start, self.cost.duration(&shape));
        Ok(out)
    }

    fn idle(&mut self) {
        self.last_deadline = None;
    }

    fn read_block(&self, id: BlockId) -> Vec<u8> {
        self.slots[id as usize]
            .iter()
            .flat_map(|s| {
                let mut b = [0u8; SLOT_BYTES];
                b[..4].copy_from_slice(&s.token.to_le_bytes());
                b[4..].copy_from_slice(&s.hash.to_le_bytes());
                b
            })
            .collect()
    }

    fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        if bytes.len() != BLOCK_SIZE * SLOT_BYTES {
            return Err(ModelError::Other(format!(
                "a sim KV block is {} bytes, not {}",
                BLOCK_SIZE * SLOT_BYTES,
                bytes.len()
            )));
        }
        let block = self
            .slots
            .get_mut(id as usize)
            .ok_or_else(|| ModelError::Other(format!("block {id} is outside the KV pool")))?;
        for (slot, b) in block.iter_mut().zip(bytes.chunks_exact(SLOT_BYTES)) {
            *slot = Slot {
                token: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
                hash: u64::from_le_bytes(b[4..].try_into().expect("8 bytes")),
            };
        }
        Ok(())
    }
}

/// Bytes of one KV block of a sim worker.
pub const fn block_bytes() -> usize {
    BLOCK_SIZE * SLOT_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::profile::SimProfile;

    fn model(blocks: usize) -> SimModel {
        let mut cost = SimProfile::load("cpu-smollm2").unwrap().step;
        cost.overhead_us = 0.0;
        cost.prefill_token_us = 0.001;
        cost.decode_token_us = 0.001;
        SimModel::new(
            blocks,
            cost,
            TokenChoice::new(1000, &[999]),
            Histogram::new([0.001]),
        )
    }

    fn token(out: &StepOutput) -> u32 {
        match out {
            StepOutput::Token(t) => *t,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_next_token_follows_the_history_not_the_batching() {
        let prompt: Vec<u32> = (0..40).collect();
        // Whole prompt in one step.
        let mut a = model(8);
        let whole = a
            .forward(
                &[SequenceStep {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &[0, 1, 2],
                }],
                &[false],
            )
            .unwrap();
        // In two chunks, on other blocks.
        let mut b = model(8);
        let table = [5, 3, 7];
        b.forward(
            &[SequenceStep {
                tokens: &prompt[..20],
                start_pos: 0,
                block_table: &table,
            }],
            &[false],
        )
        .unwrap();
        let chunked = b
            .forward(
                &[SequenceStep {
                    tokens: &prompt[20..],
                    start_pos: 20,
                    block_table: &table,
                }],
                &[false],
            )
            .unwrap();
        assert_eq!(token(&whole[0]), token(&chunked[0]));
        // A block copied over as bytes carries the history with it.
        let mut c = model(8);
        for (from, to) in [(0, 4), (1, 6)] {
            c.write_block(to, &a.read_block(from)).unwrap();
        }
        c.write_block(2, &a.read_block(2)).unwrap();
        let imported = c
            .forward(
                &[SequenceStep {
                    tokens: &prompt[39..],
                    start_pos: 39,
                    block_table: &[4, 6, 2],
                }],
                &[false],
            )
            .unwrap();
        assert_eq!(token(&imported[0]), token(&whole[0]));
        // Another history, another token (almost always; these two differ).
        let other: Vec<u32> = (1..41).collect();
        let mut d = model(8);
        let out = d
            .forward(
                &[SequenceStep {
                    tokens: &other,
                    start_pos: 0,
                    block_table: &[0, 1, 2],
                }],
                &[false],
            )
            .unwrap();
        assert_ne!(token(&out[0]), token(&whole[0]));
        assert!((125..1000).contains(&token(&whole[0])) && token(&whole[0]) != 999);
    }

    #[test]
    fn unwritten_history_and_bad_blocks_are_errors() {
        let mut m = model(4);
        let err = m
            .forward(
                &[SequenceStep {
                    tokens: &[1],
                    start_pos: 5,
                    block_table: &[0],
                }],
                &[false],
            )
            .unwrap_err();
        assert!(err.to_string().contains("never written"), "{err}");
        assert!(m.write_block(0, &[0; 5]).is_err());
        assert!(m.write_block(9, &[0; BLOCK_SIZE * SLOT_BYTES]).is_err());
    }

    #[test]
    fn all_rows_give_one_hot_logits_of_the_same_tokens() {
        let prompt: Vec<u32> = (7..30).collect();
        let mut a = model(4);
        let rows = a
            .forward(
                &[SequenceStep {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &[0, 1],
                }],
                &[true],
            )
            .unwrap();
        let StepOutput::Logits(logits) = &rows[0] else {
            panic!("rows asked for")
        };
        let last = &logits[(prompt.len() - 1) * 1000..];
        let argmax = (0..1000)
            .max_by(|&x, &y| last[x].total_cmp(&last[y]))
            .unwrap();
        let mut b = model(4);
        let one = b
            .forward(
                &[SequenceStep {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &[0, 1],
                }],
                &[false],
            )
            .unwrap();
        assert_eq!(argmax as u32, token(&one[0]));
    }

    #[test]
    fn a_step_lasts_what_the_profile_gives() {
        let mut m = model(4);
        m.cost.overhead_us = 20_000.0;
        let started = Instant::now();
        m.forward(
            &[SequenceStep {
                tokens: &[1, 2],
                start_pos: 0,
                block_table: &[0],
            }],
            &[false],
        )
        .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(20));
    }
}
