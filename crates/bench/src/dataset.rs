//! Synthetic prompts of a controlled token length.
//!
//! The approximation: a prompt of `n` tokens is `n` words drawn at random from
//! [`WORDS`], each written with a leading space. Byte-level BPE tokenizers (GPT-2/4,
//! Llama 3, SmolLM, Qwen) split text at spaces before merging and hold every one of
//! these common words as a single `Ġword` token, so such a prompt is `n` tokens, plus
//! whatever the server adds (a BOS token, the chat template). The list was checked
//! against SmolLM2-135M-Instruct's vocabulary (every entry is one token). SentencePiece
//! vocabularies (Llama 2, Mistral) hold them as `▁word` tokens too, for the same count.
//! The report always uses the server's `usage.prompt_tokens` when it is given, so this
//! approximation only steers the load, it never enters a metric.
//!
//! With `--tokenizer-gguf PATH` the served model's tokenizer (read from its GGUF) makes
//! the length exact instead: words are added or the token ids cut until the prompt
//! encodes to exactly `n` tokens (without BOS).
//!
//! Random words make every prompt distinct from its first tokens, so prefix caches do
//! not share work between requests of a `serve` run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdserve_model::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::BenchError;

/// Common English words that are one token each (with their leading space).
#[rustfmt::skip]
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "with", "as", "by", "at",
    "from", "his", "it", "an", "were", "are", "which", "be", "this", "has", "had", "not", "but",
    "or", "also", "their", "its", "first", "after", "one", "two", "new", "other", "more",
    "been", "they", "who", "all", "time", "may", "over", "into", "most", "than", "some",
    "would", "only", "these", "years", "during", "between", "many", "under", "such", "about",
    "when", "world", "three", "state", "city", "used", "called", "both", "where", "known",
    "there", "while", "well", "part", "them", "later", "several", "since", "then", "year",
    "school", "area", "made", "until", "through", "number", "people", "work", "high", "early",
    "found", "same", "small", "large", "because", "before", "life", "water", "group", "music",
    "each", "system", "name", "second", "being", "long", "public", "american", "national",
    "united", "form", "four", "home", "family", "last", "history", "game", "film", "series",
    "team", "season", "book", "war", "power", "based", "without", "best", "often", "around",
    "general", "government", "house", "following", "include", "children", "death", "country",
    "great", "place", "point", "major", "common", "body", "order", "light", "line", "land",
    "local", "market", "means", "field", "human", "model", "report", "service", "sound",
    "south", "north", "west", "east", "space", "story", "study", "term", "type", "value",
    "word", "black", "white", "final", "free", "full", "good", "green", "hand", "head", "heart",
    "king", "law", "level", "little", "low", "main", "mind", "money", "night", "open", "paper",
    "party", "play", "police", "real", "red", "road", "room", "side", "single", "social",
    "special", "start", "street", "table", "town", "tree", "voice", "wall", "window", "woman",
    "young",
];

/// One planned request: its prompt and how many tokens to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticRequest {
    /// The prompt text.
    pub prompt: String,
    /// Tokens the prompt was built to have (before BOS or a chat template).
    pub prompt_tokens: u64,
    /// `max_tokens` for this request.
    pub output_tokens: u64,
}

/// The served model's tokenizer, with the file it came from (for error messages).
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    path: PathBuf,
}

impl PromptTokenizer {
    /// Loads the tokenizer of a GGUF file (metadata only, no weights).
    pub fn load(path: &Path) -> Result<Arc<Self>, BenchError> {
        let tokenizer = Tokenizer::load(path).map_err(|e| BenchError::Tokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Arc::new(Self {
            tokenizer,
            path: path.to_path_buf(),
        }))
    }

    /// The GGUF file the tokenizer came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, e: pdserve_model::ModelError) -> BenchError {
        BenchError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }

    /// Token ids of `text`, without BOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, BenchError> {
        self.tokenizer
            .encode(text, false)
            .map_err(|e| self.error(e))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BenchError> {
        self.tokenizer.decode(ids, false).map_err(|e| self.error(e))
    }
}

/// Loads `--tokenizer-gguf`, if given.
pub fn load_tokenizer(path: Option<&Path>) -> Result<Option<Arc<PromptTokenizer>>, BenchError> {
    path.map(PromptTokenizer::load).transpose()
}

/// Draws prompts and lengths from a seeded generator, so a seed fixes the workload.
pub struct PromptGenerator {
    rng: StdRng,
    tokenizer: Option<Arc<PromptTokenizer>>,
}

impl PromptGenerator {
    /// A generator whose output depends only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            tokenizer: None,
        }
    }

    /// Sizes prompts exactly with `tokenizer` (when given) instead of the approximation.
    pub fn with_tokenizer(mut self, tokenizer: Option<Arc<PromptTokenizer>>) -> Self {
        self.tokenizer = tokenizer;
        self
    }

    /// A prompt of `tokens` tokens: exact with a tokenizer, else [`Self::words`].
    pub fn prompt(&mut self, tokens: u64) -> Result<String, BenchError> {
        let mut text = self.words(tokens);
        let Some(tokenizer) = self.tokenizer.clone() else {
            return Ok(text);
        };
        let want = tokens as usize;
        // Each round either adds words (too short) or cuts ids (too long); cutting ids
        // and decoding can re-merge at the cut, hence a few rounds.
        for _ in 0..8 {
            let ids = tokenizer.encode(&text)?;
            match ids.len().cmp(&want) {
                std::cmp::Ordering::Equal => return Ok(text),
                std::cmp::Ordering::Less => text.push_str(&self.words((want - ids.len()) as u64)),
                std::cmp::Ordering::Greater => {
                    text = tokenizer.decode(&ids[..want])?;
                }
            }
        }
        Ok(text)
    }

    /// `tokens` random words, each with its leading space.
    pub fn words(&mut self, tokens: u64) -> String {
        let mut out = String::with_capacity(tokens as usize * 7);
        for _ in 0..tokens {
            out.push(' ');
            out.push_str(WORDS[self.rng.random_range(0..WORDS.len())]);
        }
        out
    }

    /// A length drawn uniformly from `[len * (1 - ratio), len * (1 + ratio)]`, at least 1.
    pub fn length(&mut self, len: u64, ratio: f64) -> u64 {
        if ratio <= 0.0 {
            return len.max(1);
        }
        let low = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as u64;
        let high = ((len as f64) * (1.0 + ratio)).ceil().max(1.0) as u64;
        self.rng.random_range(low..=high.max(low))
    }

    /// `count` requests around `input_len` prompt and `output_len` output tokens.
    pub fn requests(
        &mut self,
        count: u64,
        input_len: u64,
        output_len: u64,
        range_ratio: f64,
    ) -> Result<Vec<SyntheticRequest>, BenchError> {
        (0..count)
            .map(|_| {
                let prompt_tokens = self.length(input_len, range_ratio);
                let output_tokens = self.length(output_len, range_ratio);
                Ok(SyntheticRequest {
                    prompt: self.prompt(prompt_tokens)?,
                    prompt_tokens,
                    output_tokens,
                })
            })
            .collect()
    }
}

impl PromptGenerator {
    /// SGLang's generated-shared-prefix set: `groups` system prompts of `system_len`
    /// tokens, each followed by `per_group` questions of `question_len` tokens, shuffled
    /// (seeded) so that groups interleave as concurrent tenants' requests do.
    pub fn shared_prefix(
        &mut self,
        groups: u64,
        per_group: u64,
        system_len: u64,
        question_len: u64,
        output_len: u64,
    ) -> Result<Vec<SyntheticRequest>, BenchError> {
        let mut requests = Vec::with_capacity((groups * per_group) as usize);
        for _ in 0..groups {
            let system = self.prompt(system_len)?;
            for _ in 0..per_group {
                let question = self.prompt(question_len)?;
                requests.push(SyntheticRequest {
                    prompt: format!("{system}{question}"),
                    prompt_tokens: system_len + question_len,
                    output_tokens: output_len,
                });
            }
        }
        // Fisher-Yates with the generator's own seeded stream.
        for i in (1..requests.len()).rev() {
            let j = self.rng.random_range(0..=i);
            requests.swap(i, j);
        }
        Ok(requests)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_groups_share_their_system_prompt_and_are_interleaved() {
        let a = PromptGenerator::new(3)
            .shared_prefix(4, 5, 40, 6, 9)
            .unwrap();
        assert_eq!(
            a,
            PromptGenerator::new(3)
                .shared_prefix(4, 5, 40, 6, 9)
                .unwrap()
        );
        assert_eq!(a.len(), 20);
        let prefix =
            |r: &SyntheticRequest| r.prompt.split(' ').take(41).collect::<Vec<_>>().join(" ");
        let mut groups: std::collections::HashMap<String, usize> = Default::default();
        for r in &a {
            assert_eq!((r.prompt_tokens, r.output_tokens), (46, 9));
            assert_eq!(r.prompt.split_whitespace().count(), 46);
            *groups.entry(prefix(r)).or_default() += 1;
        }
        assert_eq!(groups.len(), 4, "four system prompts");
        assert!(groups.values().all(|&n| n == 5));
        let first_four: std::collections::HashSet<String> = a[..8].iter().map(prefix).collect();
        assert!(first_four.len() > 1, "groups interleave");
    }

    #[test]
    fn prompts_have_the_requested_word_count_and_depend_only_on_the_seed() {
        let a = PromptGenerator::new(7).requests(20, 50, 10, 0.0).unwrap();
        let b = PromptGenerator::new(7).requests(20, 50, 10, 0.0).unwrap();
        assert_eq!(a, b);
        for r in &a {
            assert_eq!(r.prompt.split_whitespace().count(), 50);
            assert_eq!((r.prompt_tokens, r.output_tokens), (50, 10));
        }
        assert_ne!(a[0].prompt, a[1].prompt, "prompts differ");
        assert_ne!(
            a,
            PromptGenerator::new(8).requests(20, 50, 10, 0.0).unwrap()
        );
    }

    #[test]
    fn range_ratio_spreads_lengths_within_bounds() {
        let reqs = PromptGenerator::new(1).requests(500, 100, 20, 0.5).unwrap();
        assert!(reqs.iter().all(|r| (50..=150).contains(&r.prompt_tokens)));
        assert!(reqs.iter().all(|r| (10..=30).contains(&r.output_tokens)));
        let distinct: std::collections::HashSet<_> = reqs.iter().map(|r| r.prompt_tokens).collect();
        assert!(distinct.len() > 50, "lengths vary: {}", distinct.len());
        let mean = reqs.iter().map(|r| r.prompt_tokens).sum::<u64>() as f64 / 500.0;
        assert!((mean - 100.0).abs() < 5.0, "mean {mean}");
    }

    #[test]
    fn words_are_distinct_and_plain() {
        let set: std::collections::HashSet<_> = WORDS.iter().collect();
        assert_eq!(set.len(), WORDS.len());
        assert!(WORDS
            .iter()
            .all(|w| w.chars().all(|c| c.is_ascii_lowercase())));
    }
}
