//! The model as the scheduler drives it: one batched forward step over a KV pool it owns.
//! The real implementation wraps `pdserve_model::Model`; unit tests use a small
//! deterministic fake that checks every block table it is given.

use std::sync::Arc;

use pdserve_model::{BlockId, KvStore, Model, ModelError, SequenceStep};

/// What one step gives for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// The logits of its last new token, or of every new token (`tokens * vocab`) when
    /// all rows were asked for; the sequence's sampler chooses the token.
    Logits(Vec<f32>),
    /// The next token, chosen by the model itself (a simulated engine, whose output is a
    /// function of the token history whatever the sampling parameters).
    Token(u32),
}

/// A model plus its KV pool, as the scheduler thread owns them.
pub trait StepModel: Send + 'static {
    /// Blocks in the KV pool.
    fn num_blocks(&self) -> usize;
    /// One batched step; returns, for each sequence, the logits of its last new token
    /// (or of every new token, for a sequence whose `all_rows` entry is set), or the
    /// token the model chose itself (never for an `all_rows` sequence).
    fn forward(
        &mut self,
        batch: &[SequenceStep<'_>],
        all_rows: &[bool],
    ) -> Result<Vec<StepOutput>, ModelError>;
    /// The scheduler ran out of work and waits for more: the next step starts afresh,
    /// not where the last one ended.
    fn idle(&mut self) {}
    /// One block's KV as bytes (for KV transfer).
    fn read_block(&self, id: BlockId) -> Vec<u8>;
    /// Overwrites one block from bytes made by `read_block`.
    fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError>;
}

impl<M: StepModel + ?Sized> StepModel for Box<M> {
    fn num_blocks(&self) -> usize {
        (**self).num_blocks()
    }

    fn forward(
        &mut self,
        batch: &[SequenceStep<'_>],
        all_rows: &[bool],
    ) -> Result<Vec<StepOutput>, ModelError> {
        (**self).forward(batch, all_rows)
    }

    fn idle(&mut self) {
        (**self).idle()
    }

    fn read_block(&self, id: BlockId) -> Vec<u8> {
        (**self).read_block(id)
    }

    fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        (**self).write_block(id, bytes)
    }
}

/// The real model and its paged KV store.
pub struct ModelRunner {
    model: Arc<Model>,
    kv: KvStore,
}

impl ModelRunner {
    /// A runner over a fresh KV store of `num_blocks` blocks.
    pub fn new(model: Arc<Model>, num_blocks: usize) -> Self {
        let kv = KvStore::new(model.config(), num_blocks);
        Self { model, kv }
    }

    /// The KV block format; peers exchange blocks only when theirs is equal.
    pub fn kv_layout(&self) -> String {
        self.kv.layout()
    }

    /// Bytes in one KV block as `read_block` returns it.
    pub fn kv_block_bytes(&self) -> usize {
        self.kv.block_bytes()
    }
}

impl StepModel for ModelRunner {
    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn forward(
        &mut self,
        batch: &[SequenceStep<'_>],
        all_rows: &[bool],
    ) -> Result<Vec<StepOutput>, ModelError> {
        let rows = self.model.forward_rows(&mut self.kv, batch, all_rows)?;
        Ok(rows.into_iter().map(StepOutput::Logits).collect())
    }

    fn read_block(&self, id: BlockId) -> Vec<u8> {
        self.kv.read_block(id)
    }

    fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        self.kv.write_block(id, bytes)
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A model whose next token is a function of the whole token history *as read back
    //! from its paged KV store*, so a wrong block table or a stale cached block changes
    //! the output, and reading a never-written slot is an error.

    use super::*;
    use pdserve_model::BLOCK_SIZE;
    use std::sync::Mutex;
    use std::time::Duration;

    /// Vocabulary of the fake; token 0 is its EOS.
    pub const VOCAB: usize = 64;

    /// Deterministic fake model.
    pub struct FakeModel {
        slots: Vec<[Option<u32>; BLOCK_SIZE]>,
        /// Batch size of every step, for assertions.
        pub batches: Arc<Mutex<Vec<usize>>>,
        /// Sleep per step, so tests can make requests overlap.
        pub step_delay: Duration,
    }

    impl FakeModel {
        pub fn new(num_blocks: usize) -> Self {
            Self {
                slots: vec![[None; BLOCK_SIZE]; num_blocks],
                batches: Arc::default(),
                step_delay: Duration::ZERO,
            }
        }
    }

    /// The token the fake produces after `history` (never EOS).
    pub fn next_token(history: &[u32]) -> u32 {
        let h = history.iter().enumerate().fold(7u64, |acc, (i, &t)| {
            acc.wrapping_mul(31)
                .wrapping_add((i as u64 + 1) * t as u64 + 3)
        });
        (h % (VOCAB as u64 - 1)) as u32 + 1
    }

    impl StepModel for FakeModel {
        fn num_blocks(&self) -> usize {
            self.slots.len()
        }

        fn forward(
            &mut self,
            batch: &[SequenceStep<'_>],
            all_rows: &[bool],
        ) -> Result<Vec<StepOutput>, ModelError> {
            std::thread::sleep(self.step_delay);
            self.batches.lock().unwrap().push(batch.len());
            let mut out = Vec::new();
            for (seq, &all) in batch.iter().zip(all_rows) {
                let end = seq.start_pos + seq.tokens.len();
                if seq.block_table.len() * BLOCK_SIZE < end {
                    return Err(ModelError::Other("block table too short".into()));
                }
                for (i, &t) in seq.tokens.iter().enumerate() {
                    let pos = seq.start_pos + i;
                    let block = seq.block_table[pos / BLOCK_SIZE] as usize;
                    self.slots[block][pos % BLOCK_SIZE] = Some(t);
                }
                let history = (0..end)
                    .map(|pos| {
                        let block = seq.block_table[pos / BLOCK_SIZE] as usize;
                        self.slots[block][pos % BLOCK_SIZE].ok_or_else(|| {
                            ModelError::Other(format!("position {pos} was never written"))
                        })
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                let rows = if all { seq.tokens.len() } else { 1 };
                let mut logits = vec![0.0; rows * VOCAB];
                for r in 0..rows {
                    let upto = end - rows + r + 1;
                    logits[r * VOCAB + next_token(&history[..upto]) as usize] = 10.0;
                }
                out.push(StepOutput::Logits(logits));
            }
            Ok(out)
        }

        fn read_block(&self, id: BlockId) -> Vec<u8> {
            self.slots[id as usize]
                .iter()
                .flat_map(|s| s.map_or(u32::MAX, |t| t).to_le_bytes())
                .collect()
        }

        fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
            for (slot, b) in self.slots[id as usize].iter_mut().zip(bytes.chunks(4)) {
                let t = u32::from_le_bytes(
                    b.try_into()
                        .map_err(|_| ModelError::Other("truncated block".into()))?,
                );
                *slot = (t != u32::MAX).then_some(t);
            }
            Ok(())
        }
    }
}
