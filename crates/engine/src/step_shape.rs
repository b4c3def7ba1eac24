//! What one forward step computes, in the terms a step's time depends on: the profiler
//! records it for every real step (to fit a simulated engine's profile), and the
//! simulated engine times its steps from it.

/// The work of one forward step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Prompt tokens computed (prefill chunks, recomputation after preemption).
    pub prefill_tokens: usize,
    /// (query, key) pairs the prompt tokens attend over: a chunk of `n` tokens after
    /// `start` tokens already in the KV (cached, imported or earlier chunks) attends over
    /// `n * start + n * (n + 1) / 2` of them.
    pub prefill_attention_pairs: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// Tokens of context the decoding sequences attend over, all together.
    pub decode_context_tokens: usize,
}

impl StepShape {
    /// Adds a sequence running `n` tokens after the `start` it holds in the KV;
    /// `decodes` when it runs its one newest token.
    pub fn add(&mut self, start: usize, n: usize, decodes: bool) {
        if decodes {
            self.decode_seqs += 1;
            self.decode_context_tokens += start + n;
        } else {
            self.prefill_tokens += n;
            self.prefill_attention_pairs += n * start + n * (n + 1) / 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_chunks_count_pairs_and_decodes_count_context() {
        let mut shape = StepShape::default();
        shape.add(0, 4, false); // 1 + 2 + 3 + 4
        shape.add(100, 2, false); // 101 + 102
        shape.add(9, 1, true);
        shape.add(19, 1, true);
        assert_eq!(
            shape,
            StepShape {
                prefill_tokens: 6,
                prefill_attention_pairs: 10 + 203,
                decode_seqs: 2,
                decode_context_tokens: 30,
            }
        );
    }
}
