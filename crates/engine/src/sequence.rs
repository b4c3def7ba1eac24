//! One request's state inside the scheduler: its tokens, how many of them have KV in the
//! pool, its block table, and the channel its output goes to.

use std::time::Instant;

use pdserve_model::{BlockId, BLOCK_SIZE};
use tokio::sync::mpsc;

use pdserve_kv_transfer::ReusedTokens;

use crate::block_manager::{BlockError, BlockHash, BlockManager};
use crate::request::{FinishReason, GenerationRequest, KvImport, SeqEvent, TokenUsage};
use crate::sampling::{logprobs, Sampler, TokenLogprobs};

/// A sequence being scheduled.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose KV is in `blocks`.
    pub num_computed: usize,
    /// Block table: position `p` lives in `blocks[p / BLOCK_SIZE]`.
    pub blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks already registered in the prefix cache.
    pub hashes: Vec<BlockHash>,
    /// Prompt tokens computed by no one for this request, set at first admission
    /// (prefix-cache hits, or what the imported KV's source reused).
    pub cached_tokens: Option<usize>,
    /// Of `cached_tokens`, those an earlier turn of the conversation computed.
    pub earlier_turn_tokens: usize,
    /// Prompt tokens loaded from a peer's KV at first admission.
    pub kv_imported_tokens: usize,
    /// Still holds a slot of the bounded waiting queue (never admitted yet).
    pub holds_queue_slot: bool,
    /// When the scheduler received the request.
    pub arrived: Instant,
    /// When the last token was sampled (inter-token latency).
    last_token_at: Option<Instant>,
    /// Prompt log-probabilities computed so far (entry `i` scores prompt token `i + 1`);
    /// kept across a preemption, so a recomputed prompt is not scored twice.
    prompt_logprobs: Vec<TokenLogprobs>,
    /// The prompt log-probabilities were sent.
    prompt_logprobs_sent: bool,
    request: GenerationRequest,
    sampler: Sampler,
    events: mpsc::UnboundedSender<SeqEvent>,
}

impl Sequence {
    /// A new sequence for `request`, reporting to `events`.
    pub fn new(request: GenerationRequest, events: mpsc::UnboundedSender<SeqEvent>) -> Self {
        let mut sampler = Sampler::for_prompt(request.sampling.clone(), &request.prompt);
        let mut tokens = request.prompt.clone();
        // A given first token was reported when the request was submitted.
        let last_token_at = request.first_token.map(|token| {
            sampler.replay(token);
            tokens.push(token);
            Instant::now()
        });
        Self {
            tokens,
            prompt_len: request.prompt.len(),
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            cached_tokens: None,
            earlier_turn_tokens: 0,
            kv_imported_tokens: 0,
            holds_queue_slot: true,
            arrived: Instant::now(),
            last_token_at,
            prompt_logprobs: Vec::new(),
            prompt_logprobs_sent: false,
            sampler,
            request,
            events,
        }
    }

    /// Where its instants are noted, when the request is traced.
    pub fn trace(&self) -> Option<&crate::trace::SeqTrace> {
        self.request.trace.as_deref()
    }

    /// The request's `priority` (lower first, under priority scheduling).
    pub fn priority(&self) -> i64 {
        self.request.priority
    }

    /// Whether the blocks stay pinned for a peer when the sequence finishes.
    pub fn pin_on_finish(&self) -> bool {
        self.request.pin_on_finish
    }

    /// Whether its exported blocks are copied out as it finishes (a prefill for a peer).
    pub fn copy_on_finish(&self) -> bool {
        self.request.copy_on_finish
    }

    /// The KV to load at first admission (taken: a preempted sequence recomputes).
    pub fn take_kv_import(&mut self) -> Option<KvImport> {
        self.request.kv_import.take()
    }

    /// The KV to load, if any, without taking it.
    pub fn kv_import(&self) -> Option<&KvImport> {
        self.request.kv_import.as_ref()
    }

    /// Where its prompt's KV goes as it is computed, for a reader already waiting.
    pub fn kv_feed(&self) -> Option<&crate::kv_feed::KvFeed> {
        self.request.kv_feed.as_deref()
    }

    /// Whether it started from a first token sampled elsewhere.
    pub fn has_given_first_token(&self) -> bool {
        self.request.first_token.is_some()
    }

    /// Whether its given first token already ends it (`max_tokens` 1, or a stop token
    /// that `min_tokens` does not hold back): nothing would be left to run here.
    pub fn ends_at_given_token(&self) -> bool {
        self.request.first_token.is_some_and(|token| {
            self.request.max_new_tokens <= 1
                || (self.request.min_new_tokens == 0
                    && self.request.stop_token_ids.contains(&token))
        })
    }

    /// Whether the prompt is scored (`prompt_logprobs`): the whole prompt is computed,
    /// without prefix-cache hits.
    pub fn scores_prompt(&self) -> bool {
        self.request.prompt_logprobs.is_some()
    }

    /// Whether the next step over `n` new tokens must return every row's logits: the
    /// chunk holds prompt positions whose successor is not scored yet.
    pub fn needs_all_rows(&self) -> bool {
        self.request.prompt_logprobs.is_some()
            && !self.prompt_logprobs_sent
            && self.num_computed < self.prompt_len
            && self.prompt_logprobs.len() + 1 < self.prompt_len
    }

    /// Scores the prompt tokens that follow the positions of the step just run (one
    /// logit row per position from `start`, `rows` of them), and returns the logits of
    /// the step's last position.
    pub fn score_prompt_rows<'a>(
        &mut self,
        logits: &'a [f32],
        start: usize,
        rows: usize,
    ) -> &'a [f32] {
        let vocab = logits.len() / rows.max(1);
        let top = self.request.prompt_logprobs.unwrap_or(0);
        for r in 0..rows {
            let pos = start + r;
            // Row `pos` predicts token `pos + 1`; entry `pos` scores it.
            if pos + 1 < self.prompt_len && self.prompt_logprobs.len() == pos {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let lp = logprobs(row, self.tokens[pos + 1], top);
                self.prompt_logprobs.push(lp);
            }
        }
        &logits[rows.saturating_sub(1) * vocab..]
    }

    /// Sends the prompt log-probabilities once the whole prompt is scored (the last
    /// prompt position predicts the first generated token, not a prompt token).
    pub fn send_prompt_logprobs(&mut self) {
        if self.scores_prompt()
            && !self.prompt_logprobs_sent
            && self.prompt_logprobs.len() + 1 >= self.prompt_len
        {
            self.prompt_logprobs_sent = true;
            let lps = std::mem::take(&mut self.prompt_logprobs);
            let _ = self.events.send(SeqEvent::PromptLogprobs(lps));
        }
    }

    /// Whether the request only scores its prompt (`max_tokens` 0): it ends once the
    /// prompt is computed, generating nothing.
    pub fn generates_nothing(&self) -> bool {
        self.request.max_new_tokens == 0
    }

    /// Tokens generated so far.
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next token can be sampled.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// The client went away (its receiver was dropped).
    pub fn is_cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// Blocks to add so that the first `len` positions have a block.
    pub fn blocks_missing(&self, len: usize) -> usize {
        len.div_ceil(BLOCK_SIZE).saturating_sub(self.blocks.len())
    }

    /// Token counts for the usage report.
    pub fn usage(&self) -> TokenUsage {
        TokenUsage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.num_generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            earlier_turn_tokens: self.earlier_turn_tokens,
            kv_imported_tokens: self.kv_imported_tokens,
        }
    }

    /// The prompt tokens it did not compute, by source, for a peer importing its KV.
    pub fn reused(&self) -> ReusedTokens {
        let cached = self.cached_tokens.unwrap_or(0);
        ReusedTokens {
            prefix_cache_tokens: cached - self.earlier_turn_tokens,
            earlier_turn_tokens: self.earlier_turn_tokens,
        }
    }

    /// Gives every block back and forgets the computed KV (finish or preemption).
    pub fn release_blocks(&mut self, bm: &mut BlockManager) -> Result<(), BlockError> {
        let blocks = std::mem::take(&mut self.blocks);
        self.hashes.clear();
        self.num_computed = 0;
        bm.release(&blocks)
    }

    /// Registers every newly completed full block in the prefix cache.
    pub fn commit_full_blocks(&mut self, bm: &mut BlockManager) -> Result<(), BlockError> {
        let full = self.num_computed / BLOCK_SIZE;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied();
            let chunk = &self.tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let hash = bm.commit(self.blocks[i], parent, chunk)?;
            self.hashes.push(hash);
        }
        Ok(())
    }

    /// Samples the next token from `logits`, reports it, and says whether the sequence
    /// is finished (the caller then reports the finish).
    pub fn append_sampled(&mut self, logits: &[f32], max_model_len: usize) -> Option<FinishReason> {
        let suppress_stop = self.suppresses_stop();
        let banned: &[u32] = if suppress_stop {
            &self.request.stop_token_ids
        } else {
            &[]
        };
        let token = self.sampler.sample(logits, banned);
        let lp = self.request.logprobs.map(|n| logprobs(logits, token, n));
        self.append(token, lp, max_model_len)
    }

    /// Appends `token`, chosen by the model itself (a simulated engine): the sampler
    /// takes it as drawn, and its log-probability is 0 (the model was certain of it).
    pub fn append_chosen(&mut self, token: u32, max_model_len: usize) -> Option<FinishReason> {
        self.sampler.replay(token);
        let lp = self.request.logprobs.map(|n| TokenLogprobs {
            logprob: 0.0,
            top: if n > 0 {
                vec![(token, 0.0)]
            } else {
                Vec::new()
            },
            rank: 1,
        });
        self.append(token, lp, max_model_len)
    }

    /// Whether a stop token may not end the sequence yet (`min_tokens`).
    fn suppresses_stop(&self) -> bool {
        self.num_generated() < self.request.min_new_tokens
    }

    fn append(
        &mut self,
        token: u32,
        lp: Option<TokenLogprobs>,
        max_model_len: usize,
    ) -> Option<FinishReason> {
        let suppress_stop = self.suppresses_stop();
        self.tokens.push(token);
        // A send error means the client left; the next step reaps the sequence.
        let _ = self.events.send(SeqEvent::Token {
            id: token,
            logprobs: lp,
        });
        if !suppress_stop && self.request.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.num_generated() >= self.request.max_new_tokens
            || self.tokens.len() >= max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Marks a token sampled now; the time since the previous one, if any.
    pub fn token_gap(&mut self) -> Option<std::time::Duration> {
        let now = Instant::now();
        self.last_token_at.replace(now).map(|prev| now - prev)
    }

    /// Sends an event of the sequence; false when nobody listens any more.
    pub fn send(&self, event: SeqEvent) -> bool {
        self.events.send(event).is_ok()
    }
}
