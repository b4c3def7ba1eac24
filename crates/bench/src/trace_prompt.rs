//! Prompts for trace replay, built from a request's hash ids so that the trace's prefix
//! reuse is prefix reuse at the server.
//!
//! Each hash id names a 512-token block. Its text is a stream of one-token words (see
//! [`WORDS`]) drawn by a generator seeded with the id (and `--seed`), so equal ids give
//! equal text wherever they occur, and a partial block (a prompt's last) is a prefix of
//! the full block with the same id. Every word is one token with its leading space, and
//! byte-level BPE splits text at spaces before merging, so a block's tokens do not
//! depend on what follows it: concatenated blocks tokenize as the concatenation of their
//! tokens, and requests sharing their first k ids share their first `512 k` tokens.
//! Tokens past the hash blocks are words unique to the request.
//!
//! Prompts are built when their request is sent, not up front: a production trace's
//! prompts (tens of thousands of requests of several thousand tokens) would take
//! gigabytes.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::dataset::{PromptTokenizer, WORDS};
use crate::trace::{TraceEntry, BLOCK_TOKENS};
use crate::BenchError;

/// Mixed into block seeds, so `--seed` changes every block's text (a second run with
/// another seed finds nothing of the first in the server's cache).
const BLOCK_SEED_SALT: u64 = 0x6a09_e667_f3bc_c908;
/// Mixed into the seeds of the request-unique tail, so it never repeats a block's text.
const TAIL_SEED_SALT: u64 = 0xbb67_ae85_84ca_a73b;
/// Fewest one-token words an exact tokenizer must leave for prompts to stay varied.
const MIN_WORDS: usize = 32;

/// Builds trace requests' prompts.
#[derive(Debug, Clone)]
pub struct TracePrompts {
    seed: u64,
    /// The words blocks are drawn from: [`WORDS`], or with a tokenizer, those of them
    /// that are exactly one token in it.
    words: Vec<&'static str>,
    /// With a tokenizer, the token id of each of `words` (with its leading space): a
    /// prompt's ids are its words' ids, since no merge crosses a space.
    ids: Option<Vec<u32>>,
}

impl TracePrompts {
    /// Prompts fixed by `seed`. With the served model's `tokenizer`, only words that are
    /// one token in it are used, so a prompt has exactly `input_length` tokens (without
    /// BOS or a chat template); an error if too few are.
    pub fn new(seed: u64, tokenizer: Option<&PromptTokenizer>) -> Result<Self, BenchError> {
        let (words, ids) = match tokenizer {
            None => (WORDS.to_vec(), None),
            Some(tokenizer) => {
                let (words, ids) = one_token_words(tokenizer)?.into_iter().unzip();
                (words, Some(ids))
            }
        };
        Ok(Self {
            seed: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            words,
            ids,
        })
    }

    /// The prompt of request `index` (its position in the replay): one block of text per
    /// hash id, then request-unique words up to `input_length` tokens.
    pub fn prompt(&self, index: u64, entry: &TraceEntry) -> String {
        let mut out = String::with_capacity(entry.input_length as usize * 8);
        self.draw(index, entry, |word| {
            out.push(' ');
            out.push_str(self.words[word]);
        });
        out
    }

    /// The token ids of [`Self::prompt`]'s text (`--tokenize-prompt`), without BOS;
    /// `None` when the prompts were not built with a tokenizer.
    pub fn prompt_ids(&self, index: u64, entry: &TraceEntry) -> Option<Vec<u32>> {
        let ids = self.ids.as_ref()?;
        let mut out = Vec::with_capacity(entry.input_length as usize);
        self.draw(index, entry, |word| out.push(ids[word]));
        Some(out)
    }

    /// Calls `push` with the index in `words` of each word of request `index`'s prompt.
    fn draw(&self, index: u64, entry: &TraceEntry, mut push: impl FnMut(usize)) {
        let mut left = entry.input_length;
        for &id in &entry.hash_ids {
            // Only the last block can be partial: the reader allows no more blocks than
            // the prompt fills.
            let n = left.min(BLOCK_TOKENS);
            self.stream(id ^ self.seed ^ BLOCK_SEED_SALT, n, &mut push);
            left -= n;
        }
        if left > 0 {
            self.stream(index ^ self.seed ^ TAIL_SEED_SALT, left, &mut push);
        }
    }

    /// The first `n` words of the stream seeded by `key`.
    fn stream(&self, key: u64, n: u64, push: &mut impl FnMut(usize)) {
        let mut rng = StdRng::seed_from_u64(key);
        for _ in 0..n {
            push(rng.random_range(0..self.words.len()));
        }
    }
}

/// The words of [`WORDS`] that are one token in `tokenizer`, with that token's id,
/// checked to stay one token each when concatenated (no merges across the spaces).
fn one_token_words(tokenizer: &PromptTokenizer) -> Result<Vec<(&'static str, u32)>, BenchError> {
    let mut words = Vec::new();
    for &word in WORDS {
        if let [id] = tokenizer.encode(&format!(" {word}"))?[..] {
            words.push((word, id));
        }
    }
    let joined: String = words.iter().map(|(w, _)| format!(" {w}")).collect();
    let joined_ids = tokenizer.encode(&joined)?;
    let joined_tokens = joined_ids.len();
    let ids_kept = joined_ids.iter().eq(words.iter().map(|(_, id)| id));
    if words.len() < MIN_WORDS || !ids_kept {
        return Err(BenchError::Tokenizer {
            path: tokenizer.path().to_path_buf(),
            reason: format!(
                "trace replay builds prompts from words that are one token each, and only \
                 {} of the bench's {} words are (concatenated: {joined_tokens} tokens); \
                 replay without --tokenizer-gguf (lengths are then approximate)",
                words.len(),
                WORDS.len()
            ),
        });
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(input_length: u64, hash_ids: &[u64]) -> TraceEntry {
        TraceEntry {
            timestamp: 0.0,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
        }
    }

    fn words(text: &str) -> Vec<&str> {
        text.split_whitespace().collect()
    }

    #[test]
    fn equal_hash_ids_give_equal_blocks_and_partial_blocks_are_prefixes() {
        let p = TracePrompts::new(1, None).unwrap();
        let a = p.prompt(0, &entry(1100, &[7, 8, 9]));
        let b = p.prompt(1, &entry(1024 + 30, &[7, 8, 10]));
        let c = p.prompt(2, &entry(300, &[8]));
        let (a, b, c) = (words(&a), words(&b), words(&c));
        assert_eq!((a.len(), b.len(), c.len()), (1100, 1054, 300));
        assert_eq!(a[..1024], b[..1024], "blocks 7 and 8 shared");
        assert_ne!(a[1024..1054], b[1024..1054], "blocks 9 and 10 differ");
        assert_eq!(
            c[..],
            a[512..812],
            "block 8 cut short is a prefix of block 8"
        );
    }

    #[test]
    fn tokens_past_the_blocks_are_unique_to_the_request_and_the_seed_changes_all() {
        let p = TracePrompts::new(1, None).unwrap();
        let e = entry(600, &[3]);
        let (a, b) = (p.prompt(0, &e), p.prompt(1, &e));
        assert_eq!(a, p.prompt(0, &e), "deterministic");
        let (a, b) = (words(&a), words(&b));
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..], b[512..], "tails are the requests' own");
        let other = TracePrompts::new(2, None).unwrap().prompt(0, &e);
        assert_ne!(words(&other)[..512], a[..512], "another seed, other blocks");
        let no_blocks = p.prompt(5, &entry(40, &[]));
        assert_eq!(words(&no_blocks).len(), 40);
    }
}
