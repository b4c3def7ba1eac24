//! One sequence's output as every API consumes it: scheduler events turned into text
//! pieces (stop strings applied), log-probabilities and a final usage report.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use pdserve_protocol::{ApiError, KvTransferParams, Usage};

use super::ServingContext;
use crate::kv::service::release_unpublished;
use crate::kv::Publish;
use crate::output_text::{OutputText, TokenText};
use crate::request::{FinishReason, PinnedKv, SeqEvent, SeqEvents};
use crate::sampling::TokenLogprobs;
use crate::trace::{GenerationEnd, GenerationTrace};

pub use super::prompt_echo::{EchoPlan, PromptEcho, PromptScores};

/// A token's log-probability information, with token text resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedLogprob {
    /// The sampled token's bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// Alternatives: bytes and log-probability, most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
    /// Byte offset of this token's text in the output (completions `text_offset`).
    pub text_offset: usize,
    /// The sampled token's id (SGLang's `output_token_logprobs` name it).
    pub id: u32,
    /// The alternatives' token ids, in `top`'s order.
    pub top_ids: Vec<u32>,
}

/// One thing to tell the client.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The prompt part (echoed text, prompt tokens and their log-probabilities), before
    /// any token; only for a generation made [`Generation::echoing`].
    Prompt(PromptEcho),
    /// Output text for one generated token (possibly empty), with its logprob if asked.
    Token {
        /// The token's id.
        id: u32,
        /// Text to append.
        text: String,
        /// Present when the request asked for logprobs.
        logprob: Option<ResolvedLogprob>,
    },
    /// Text released at the end (held back for a possible stop string, or incomplete).
    Tail(String),
    /// The output is complete.
    End {
        /// OpenAI `finish_reason`.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
        /// Where a peer can read this request's KV (`kv_transfer_params`), if published.
        kv_transfer_params: Option<KvTransferParams>,
    },
    /// The engine failed; nothing follows.
    Error(ApiError),
}

/// Another task this output depends on (a concurrent prefill leg): the output stands
/// only if it succeeds.
pub type Companion = Pin<Box<dyn Future<Output = Result<(), ApiError>> + Send>>;

/// Reads a sequence's events and produces [`Piece`]s.
pub struct Generation {
    ctx: Arc<ServingContext>,
    events: SeqEvents,
    text: OutputText,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    earlier_turn_tokens: usize,
    kv_imported_tokens: usize,
    /// Set when a stop string ended the output before the scheduler did.
    pending_end: Option<Vec<Piece>>,
    done: bool,
    /// How to publish the blocks the finished sequence leaves pinned.
    publish: Option<Publish>,
    /// The end piece carries no `kv_transfer_params` (an SGLang bootstrap prefill: its
    /// reader found the KV by room, and SGLang's answers have no such field).
    hide_kv_params: bool,
    /// Raced against every event; awaited before the end.
    companion: Option<Companion>,
    /// A piece taken by [`Generation::prime`], returned first.
    primed: Option<Piece>,
    /// What to report of the prompt, until it is reported.
    echo: Option<EchoPlan>,
    /// Bytes in front of the output text (the echoed prompt), for `text_offset`.
    offset_base: usize,
    /// Its spans, recorded when it ends (traced requests only).
    trace: Option<GenerationTrace>,
}

/// What woke a generation waiting for its next event.
enum Wake {
    Event(Option<SeqEvent>),
    Companion(Result<(), ApiError>),
}

impl Generation {
    /// Output of a submitted sequence of `prompt_tokens` tokens, cut at `stop` strings.
    pub fn new(
        ctx: Arc<ServingContext>,
        events: SeqEvents,
        prompt_tokens: usize,
        stop: Vec<String>,
    ) -> Self {
        Self {
            ctx,
            events,
            text: OutputText::new(stop),
            prompt_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
            earlier_turn_tokens: 0,
            kv_imported_tokens: 0,
            pending_end: None,
            done: false,
            publish: None,
            hide_kv_params: false,
            companion: None,
            primed: None,
            echo: None,
            offset_base: 0,
            trace: None,
        }
    }

    /// Records its spans under `trace` when it ends.
    pub fn traced(mut self, trace: Option<GenerationTrace>) -> Self {
        self.trace = trace;
        self
    }

    /// Records the spans of a traced generation that ended with `outcome`.
    fn end_trace(&mut self, outcome: Result<&'static str, &str>) {
        if let Some(trace) = self.trace.take() {
            trace.end(GenerationEnd {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.completion_tokens,
                cached_tokens: self.cached_tokens,
                kv_imported_tokens: self.kv_imported_tokens,
                outcome,
            });
        }
    }

    /// Reports the prompt as `plan` says (a [`Piece::Prompt`] first): with
    /// [`PromptScores::Computed`] once the scheduler scored it, otherwise at once.
    pub fn echoing(mut self, plan: EchoPlan) -> Self {
        self.offset_base = plan.text.as_ref().map_or(0, String::len);
        self.echo = Some(plan);
        self
    }

    /// The prompt piece, when the plan needs nothing from the scheduler.
    fn ready_echo(&mut self) -> Option<Piece> {
        if matches!(self.echo.as_ref()?.scores, PromptScores::Computed) {
            return None;
        }
        let plan = self.echo.take()?;
        Some(Piece::Prompt(plan.resolve(self.ctx.text.tokenizer(), None)))
    }

    /// Publishes the finished sequence's pinned blocks as `publish` says (the request was
    /// submitted with `pin_on_finish`); the end piece then carries their
    /// `kv_transfer_params`.
    pub fn publishing(mut self, publish: Option<Publish>) -> Self {
        self.publish = publish;
        self
    }

    /// Leaves `kv_transfer_params` out of the end piece (the KV is still published).
    pub fn hiding_kv_params(mut self) -> Self {
        self.hide_kv_params = true;
        self
    }

    /// Tokens in the prompt.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Makes the output depend on `companion`: its failure ends the output with its
    /// error as soon as it is seen, and the end piece waits for it.
    pub fn with_companion(mut self, companion: Companion) -> Self {
        self.companion = Some(companion);
        self
    }

    /// Waits for the first piece and returns it if it is an error, so the caller can
    /// answer a plain JSON error instead of starting a stream (the first piece decides
    /// JSON vs SSE). Any other piece is kept and returned first by [`Generation::next`].
    pub async fn prime(&mut self) -> Option<ApiError> {
        match self.next().await? {
            Piece::Error(e) => Some(e),
            piece => {
                self.primed = Some(piece);
                None
            }
        }
    }

    fn publish(&mut self, pinned: Option<PinnedKv>) -> Option<KvTransferParams> {
        let pinned = pinned?;
        match (&self.ctx.kv.service, self.publish.take()) {
            (Some(service), Some(plan)) => {
                let id = plan.name.as_ref().map(|n| n.id().to_string());
                // `plan` (and with it the announcement of a reader-chosen id) is dropped
                // only after the publication is in the table.
                let params = service.publish_as(pinned, plan.kind, id);
                let published = params.as_ref().and_then(|p| p.remote_request_id.as_deref());
                if let (Some(trace), Some(id)) = (&self.trace, published) {
                    trace.published(id);
                }
                params.filter(|_| !self.hide_kv_params)
            }
            _ => {
                release_unpublished(&self.ctx.engine, pinned.blocks);
                None
            }
        }
    }

    fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens as u64,
            self.completion_tokens as u64,
            self.cached_tokens as u64,
        )
        .with_sources(
            self.earlier_turn_tokens as u64,
            self.kv_imported_tokens as u64,
        )
    }

    /// The next piece, or `None` after `End`/`Error`.
    pub async fn next(&mut self) -> Option<Piece> {
        if let Some(piece) = self.primed.take() {
            return Some(piece);
        }
        let piece = self.next_piece().await;
        if let (Some(Piece::End { .. }), Some(companion)) = (&piece, self.companion.as_mut()) {
            // Never a successful end while the leg this output depends on may still fail.
            let result = companion.await;
            self.companion = None;
            if let Err(e) = result {
                self.pending_end = None;
                self.done = true;
                return Some(Piece::Error(e));
            }
        }
        piece
    }

    /// The next event, raced against the companion while there is one.
    async fn next_event(&mut self) -> Wake {
        let Some(companion) = self.companion.as_mut() else {
            return Wake::Event(self.events.recv().await);
        };
        tokio::select! {
            biased;
            result = companion => Wake::Companion(result),
            event = self.events.recv() => Wake::Event(event),
        }
    }

    async fn next_piece(&mut self) -> Option<Piece> {
        if let Some(pending) = self.pending_end.as_mut() {
            let piece = pending.pop();
            if piece.is_none() {
                self.done = true;
            }
            return piece;
        }
        if self.done {
            return None;
        }
        if let Some(piece) = self.ready_echo() {
            return Some(piece);
        }
        loop {
            let event = match self.next_event().await {
                Wake::Event(event) => event,
                Wake::Companion(Ok(())) => {
                    self.companion = None;
                    continue;
                }
                Wake::Companion(Err(e)) => {
                    self.companion = None;
                    self.done = true;
                    // Stops the sequence in the scheduler.
                    self.events.close();
                    return Some(Piece::Error(e));
                }
            };
            let Some(event) = event else {
                self.done = true;
                return Some(Piece::Error(ApiError::internal(
                    "the engine stopped before the request finished",
                )));
            };
            match event {
                SeqEvent::Admitted {
                    cached_tokens,
                    earlier_turn_tokens,
                    kv_imported_tokens,
                } => {
                    self.cached_tokens = cached_tokens;
                    self.earlier_turn_tokens = earlier_turn_tokens;
                    self.kv_imported_tokens = kv_imported_tokens;
                }
                SeqEvent::PromptLogprobs(lps) => {
                    if let Some(plan) = self.echo.take() {
                        let tok = self.ctx.text.tokenizer();
                        return Some(Piece::Prompt(plan.resolve(tok, Some(lps))));
                    }
                }
                SeqEvent::Token { id, logprobs } => {
                    self.completion_tokens += 1;
                    let offset = self.offset_base + self.text.sent_len();
                    let tokenizer = self.ctx.text.tokenizer();
                    let step = self.text.push(tokenizer, id);
                    let logprob = logprobs.map(|lp| resolve(tokenizer, id, &lp, offset));
                    if step.stopped {
                        // Dropping our interest cancels the sequence in the scheduler.
                        self.events.close();
                        self.end_trace(Ok(FinishReason::Stop.as_str()));
                        self.pending_end = Some(vec![Piece::End {
                            finish_reason: FinishReason::Stop.as_str(),
                            usage: self.usage(),
                            kv_transfer_params: None,
                        }]);
                    }
                    return Some(Piece::Token {
                        id,
                        text: step.text,
                        logprob,
                    });
                }
                SeqEvent::Finished {
                    reason,
                    usage,
                    pinned,
                } => {
                    self.cached_tokens = usage.cached_tokens;
                    self.earlier_turn_tokens = usage.earlier_turn_tokens;
                    self.kv_imported_tokens = usage.kv_imported_tokens;
                    let kv_transfer_params = self.publish(pinned);
                    self.end_trace(Ok(reason.as_str()));
                    let tail = self.text.finish(self.ctx.text.tokenizer());
                    let end = Piece::End {
                        finish_reason: reason.as_str(),
                        usage: self.usage(),
                        kv_transfer_params,
                    };
                    if tail.is_empty() {
                        self.done = true;
                        return Some(end);
                    }
                    self.pending_end = Some(vec![end]);
                    return Some(Piece::Tail(tail));
                }
                SeqEvent::Failed(msg) => {
                    self.end_trace(Err(&msg));
                    self.done = true;
                    return Some(Piece::Error(ApiError::internal(msg)));
                }
            }
        }
    }
}

impl Drop for Generation {
    /// A response dropped early (client gone) must not strand blocks the scheduler left
    /// pinned for it: stop further events, then unpin any already queued.
    fn drop(&mut self) {
        self.end_trace(Err(
            "ended before the sequence finished (client gone or failed)",
        ));
        self.events.close();
        while let Ok(event) = self.events.try_recv() {
            if let SeqEvent::Finished {
                pinned: Some(pinned),
                ..
            } = event
            {
                release_unpublished(&self.ctx.engine, pinned.blocks);
            }
        }
    }
}

fn resolve(tok: &impl TokenText, id: u32, lp: &TokenLogprobs, offset: usize) -> ResolvedLogprob {
    ResolvedLogprob {
        bytes: tok.token_bytes(id),
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|&(t, l)| (tok.token_bytes(t), l))
            .collect(),
        text_offset: offset,
        id,
        top_ids: lp.top.iter().map(|&(t, _)| t).collect(),
    }
}

/// One finished choice of a non-streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    /// The prompt part, when the request echoes or scores its prompt.
    pub prompt: Option<PromptEcho>,
    /// The output text.
    pub text: String,
    /// Per-token logprobs, when the request asked for them.
    pub logprobs: Option<Vec<ResolvedLogprob>>,
    /// The generated token ids, when the request asked for them (`return_token_ids`).
    pub token_ids: Option<Vec<u32>>,
    /// OpenAI `finish_reason`.
    pub finish_reason: &'static str,
}
