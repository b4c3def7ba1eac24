//! What the HTTP side hands the scheduler, and what the scheduler streams back.

use std::sync::Arc;
use std::time::Instant;

use pdserve_kv_transfer::ReusedTokens;
use pdserve_model::BlockId;
use tokio::sync::mpsc;

use crate::kv_feed::KvFeed;

use crate::sampling::{SamplingParams, TokenLogprobs};

/// A tokenized generation request, validated and ready to schedule.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// How to choose tokens.
    pub sampling: SamplingParams,
    /// Most tokens to generate; 0 scores the prompt only (with `prompt_logprobs`).
    pub max_new_tokens: usize,
    /// Tokens that end the sequence (EOS), empty with `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// Stop tokens are suppressed until this many tokens were generated.
    pub min_new_tokens: usize,
    /// `Some(n)`: report each token's log-probability and its `n` top alternatives.
    pub logprobs: Option<usize>,
    /// `Some(n)`: report each prompt token's log-probability (after the first) and its
    /// `n` top alternatives. The whole prompt is then computed here: no prefix-cache hit
    /// is used (as vLLM), and KV cannot be imported.
    pub prompt_logprobs: Option<usize>,
    /// Keep the sequence's blocks pinned when it finishes, for a peer to read (KV export).
    pub pin_on_finish: bool,
    /// With `pin_on_finish`: also copy the blocks' bytes out of the pool as the sequence
    /// finishes (a prefill for a peer), so the peer's read is served from the copy at
    /// once instead of waiting for the scheduler, which may be in the middle of the next
    /// prompt's step (up to seconds on CPU).
    pub copy_on_finish: bool,
    /// Where the prompt's KV goes block by block as it is computed, for a reader already
    /// waiting (a prefill publishing under a reader-chosen id). One sequence's only.
    pub kv_feed: Option<Arc<KvFeed>>,
    /// KV computed elsewhere for the leading prompt tokens, loaded instead of computed.
    pub kv_import: Option<KvImport>,
    /// The first output token, already sampled by the prefill worker that computed the
    /// prompt (with this request's sampling): the sequence starts with it as generated,
    /// reports it at once, and its first step computes that token's position, one step
    /// sooner than recomputing the last prompt position to sample it again. The imported
    /// KV may then cover the whole prompt.
    pub first_token: Option<u32>,
    /// vLLM's `priority` (lower is served first; honoured by `--scheduling-policy
    /// priority`, which alone accepts a non-zero one).
    pub priority: i64,
    /// Where the scheduler notes the sequence's instants (traced requests only).
    pub trace: Option<std::sync::Arc<crate::trace::SeqTrace>>,
}

impl GenerationRequest {
    /// A request for `prompt` with everything else at its plain default: greedy, EOS
    /// ignored, no logprobs, no KV transfer.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            sampling: crate::sampling::SamplingParams::greedy(),
            max_new_tokens,
            stop_token_ids: Vec::new(),
            min_new_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            pin_on_finish: false,
            copy_on_finish: false,
            kv_feed: None,
            kv_import: None,
            first_token: None,
            priority: 0,
            trace: None,
        }
    }
}

/// KV blocks (as `StepModel::read_block` bytes) holding a prompt's first `num_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvImport {
    /// Leading prompt tokens the blocks hold: fewer than the prompt (the last prompt
    /// token is computed here, to get logits), or the whole prompt for a request that
    /// starts from a given `first_token` (whose position is computed here instead).
    pub num_tokens: usize,
    /// One entry per block, `ceil(num_tokens / BLOCK_SIZE)` of them.
    pub blocks: Vec<Vec<u8>>,
    /// Of `num_tokens`, those nobody computed for this request (the source's prefix-cache
    /// hits, an earlier turn's KV): reported as `cached_tokens`.
    pub reused: ReusedTokens,
    /// When the last block arrived from the peer (`pdserve_kv_import_wait_seconds`
    /// measures from here to the sequence's first step).
    pub landed_at: Option<Instant>,
}

/// Blocks left pinned by a finished `pin_on_finish` sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedKv {
    /// The blocks, in sequence order; release them with `EngineHandle::unpin`.
    pub blocks: Vec<BlockId>,
    /// Leading tokens of the sequence (prompt, then generated) whose KV they hold.
    pub num_tokens: usize,
    /// Those tokens, so a reader can check its own tokens against them.
    pub tokens: Vec<u32>,
    /// Leading prompt tokens the sequence did not compute itself, for a reader's usage.
    pub reused: ReusedTokens,
    /// When the sequence finished (`pdserve_kv_stream_tail_seconds` measures from here
    /// to the read's end).
    pub finished_at: Instant,
    /// The blocks' bytes, copied as the sequence finished (`copy_on_finish`).
    pub bytes: Option<BlockBytes>,
}

/// Exported blocks' bytes, copied out of the KV pool: one buffer per block, in order.
#[derive(Clone, PartialEq, Eq)]
pub struct BlockBytes(pub Vec<Vec<u8>>);

impl std::fmt::Debug for BlockBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockBytes({} blocks)", self.0.len())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (EOS) or, decided on the text side, a stop string.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Token counts of a finished sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenUsage {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens, including a final stop token.
    pub completion_tokens: usize,
    /// Prompt tokens computed by no one for this request: prefix-cache hits (here, or
    /// at the peer the KV was imported from) and KV an earlier turn handed back.
    pub cached_tokens: usize,
    /// Of `cached_tokens`, those an earlier turn of the conversation computed.
    pub earlier_turn_tokens: usize,
    /// Prompt tokens whose KV was loaded from a peer (`kv_import`), not computed here.
    pub kv_imported_tokens: usize,
}

/// One event of a sequence's output stream.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// The sequence joined the running batch for the first time.
    Admitted {
        /// Prompt tokens computed by no one for this request (see [`TokenUsage`]).
        cached_tokens: usize,
        /// Of `cached_tokens`, those an earlier turn of the conversation computed.
        earlier_turn_tokens: usize,
        /// Prompt tokens whose KV was loaded from a peer.
        kv_imported_tokens: usize,
    },
    /// The prompt's log-probabilities (requests with `prompt_logprobs`): entry `i` is
    /// prompt token `i + 1`'s given the tokens before it. Sent once, before any token.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// A generated token.
    Token {
        /// The token id.
        id: u32,
        /// Present when the request asked for logprobs.
        logprobs: Option<TokenLogprobs>,
    },
    /// The sequence is done; no more events follow.
    Finished {
        /// Why it stopped.
        reason: FinishReason,
        /// Its token counts.
        usage: TokenUsage,
        /// With `pin_on_finish`: the blocks kept for a peer.
        pinned: Option<PinnedKv>,
    },
    /// The engine could not run the sequence; no more events follow.
    Failed(String),
}

/// The receiving end of a sequence's events. Dropping it cancels the sequence: the
/// scheduler frees its blocks at the next step.
pub type SeqEvents = mpsc::UnboundedReceiver<SeqEvent>;
