//! One request's state inside the scheduler: its tokens, how many of them have KV in the
//! pool, its block table, and the channel its output goes to.

use std::time::Instant;

use pdserve_model::{BlockId, BLOCK_SIZE};
use tokio::sync::mpsc;

use pdserve_kv_transfer::ReusedTokens;

use crate::block_manager::{BlockError, BlockHash, BlockManager};
use crate::request::{FinishReason, GenerationRequest, KvImport, SeqEvent, TokenUsage};
use crate::sampling::{logprobs, Sampler};

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
    request: GenerationRequest,
    sampler: Sampler,
    events: mpsc::UnboundedSender<SeqEvent>,
}

impl Sequence {
    /// A new sequence for `request`, reporting to `events`.
    pub fn new(request: GenerationRequest, events: mpsc::UnboundedSender<SeqEvent>) -> Self {
        Self {
            tokens: request.prompt.clone(),
            prompt_len: request.prompt.len(),
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            cached_tokens: None,
            earlier_turn_tokens: 0,
            kv_imported_tokens: 0,
            holds_queue_slot: true,
            arrived: Instant::now(),
            last_token_at: None,
            sampler: Sampler::for_prompt(request.sampling.clone(), &request.prompt),
            request,
            events,
        }
    }

    /// Whether the blocks stay pinned for a peer when the sequence finishes.
    pub fn pin_on_finish(&self) -> bool {
        self.request.pin_on_finish
    }

    /// The KV to load at first admission (taken: a preempted sequence recomputes).
    pub fn take_kv_import(&mut self) -> Option<KvImport> {
        self.request.kv_import.take()
    }

    /// The KV to load, if any, without taking it.
    pub fn kv_import(&self) -> Option<&KvImport> {
        self.request.kv_import.as_ref()
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
        let suppress_stop = self.num_generated() < self.request.min_new_tokens;
        let banned: &[u32] = if suppress_stop {
            &self.request.stop_token_ids
        } else {
            &[]
        };
        let token = self.sampler.sample(logits, banned);
        let lp = self.request.logprobs.map(|n| logprobs(logits, token, n));
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
