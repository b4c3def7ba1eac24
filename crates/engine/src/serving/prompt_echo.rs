//! The prompt part of an answer: its text put in front of the output (completions
//! `echo`) and its tokens' log-probabilities (`echo` with `logprobs`, vLLM's
//! `prompt_logprobs`), computed by this worker's scheduler or by the prefill worker that
//! computed the prompt.

use crate::output_text::TokenText;
use crate::sampling::TokenLogprobs;

/// Where the prompt's log-probabilities come from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptScores {
    /// Not reported: the prompt tokens are listed without log-probabilities (echo without
    /// `logprobs`, or a prompt whose KV was imported and whose scores nobody sent).
    Unscored,
    /// This worker's scheduler scores the prompt (the request has `prompt_logprobs`).
    Computed,
    /// Another worker scored it (the prefill leg of a P/D request): entry `i` is prompt
    /// token `i`'s (`None` for the first token, or where the peer sent none).
    Given(Vec<Option<TokenLogprobs>>),
}

/// What a generation reports about its prompt before its first token.
#[derive(Debug, Clone, PartialEq)]
pub struct EchoPlan {
    /// The prompt's text as the answer repeats it; `None` when the prompt is not echoed.
    pub text: Option<String>,
    /// The prompt token ids.
    pub ids: Vec<u32>,
    /// Where the log-probabilities come from.
    pub scores: PromptScores,
}

/// One prompt token as an answer lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptToken {
    /// The token id.
    pub id: u32,
    /// Its raw bytes.
    pub bytes: Vec<u8>,
    /// Byte offset in the echoed text (the earlier prompt tokens' bytes summed).
    pub text_offset: usize,
    /// Its log-probability given the tokens before it; `None` for the first token and
    /// wherever the prompt was not scored.
    pub score: Option<PromptScore>,
}

/// A scored prompt token.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScore {
    /// The token's log-probability.
    pub logprob: f32,
    /// Its rank in the vocabulary (1 = most likely).
    pub rank: u32,
    /// The most likely tokens at its position: id, bytes, log-probability.
    pub top: Vec<(u32, Vec<u8>, f32)>,
}

/// The prompt part of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptEcho {
    /// The echoed text (`None` without `echo`).
    pub text: Option<String>,
    /// Every prompt token, in order.
    pub tokens: Vec<PromptToken>,
}

impl PromptEcho {
    /// Bytes the echoed text adds in front of the output (generated tokens' offsets
    /// start here).
    pub fn text_len(&self) -> usize {
        self.text.as_ref().map_or(0, String::len)
    }
}

impl EchoPlan {
    /// Resolves the plan with `scores[i]` scoring prompt token `i + 1` (the scheduler's
    /// order) when the prompt was computed here.
    pub fn resolve(self, tok: &impl TokenText, computed: Option<Vec<TokenLogprobs>>) -> PromptEcho {
        let mut given = match (self.scores, computed) {
            (_, Some(lps)) => std::iter::once(None)
                .chain(lps.into_iter().map(Some))
                .collect(),
            (PromptScores::Given(lps), None) => lps,
            _ => Vec::new(),
        };
        given.resize(self.ids.len(), None);
        let mut offset = 0;
        let tokens = self
            .ids
            .iter()
            .zip(given)
            .map(|(&id, lp)| {
                let bytes = tok.token_bytes(id);
                let token = PromptToken {
                    id,
                    text_offset: offset,
                    score: lp.map(|lp| PromptScore {
                        logprob: lp.logprob,
                        rank: lp.rank,
                        top: lp
                            .top
                            .iter()
                            .map(|&(t, l)| (t, tok.token_bytes(t), l))
                            .collect(),
                    }),
                    bytes,
                };
                offset += token.bytes.len();
                token
            })
            .collect();
        PromptEcho {
            text: self.text,
            tokens,
        }
    }
}
