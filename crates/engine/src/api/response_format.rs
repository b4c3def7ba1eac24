//! How each API shapes a request's output into chunks and responses; the output itself
//! is [`crate::serving::output`]'s.

use axum::response::Response;
use bytes::Bytes;
use pdserve_protocol::{KvTransferParams, Usage};

pub use crate::serving::output::{
    ChoiceOutput, Companion, Generation, Piece, PromptEcho, ResolvedLogprob,
};

/// How one API (chat or completions) shapes its chunks and responses; `index` is the
/// choice's (0 unless the request asked for `n` > 1).
pub trait ResponseFormat: Send + Sync + 'static {
    /// A chunk sent before any token (chat's `role: assistant`), if the API has one.
    fn start_chunk(&self, index: u32) -> Option<Bytes>;
    /// The chunk reporting the prompt part (completions `echo`), if the API has one.
    fn prompt_chunk(&self, _index: u32, _prompt: &PromptEcho) -> Option<Bytes> {
        None
    }
    /// A chunk with one piece of text and its logprob.
    fn text_chunk(&self, index: u32, text: String, logprob: Option<ResolvedLogprob>) -> Bytes;
    /// The chunk carrying `finish_reason` (and the request's `kv_transfer_params`).
    fn finish_chunk(
        &self,
        index: u32,
        finish_reason: &'static str,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Bytes;
    /// The `stream_options.include_usage` chunk (no choices).
    fn usage_chunk(&self, usage: Usage) -> Bytes;
    /// What ends a successful stream (`data: [DONE]`; nothing in the Responses API).
    fn end_chunk(&self) -> &'static [u8] {
        pdserve_protocol::sse::DONE
    }
    /// The events that end a stream with `error`.
    fn error_chunk(&self, error: &pdserve_protocol::ApiError) -> Bytes {
        let mut out = pdserve_protocol::sse::data_event(&error.to_json()).to_vec();
        out.extend_from_slice(pdserve_protocol::sse::DONE);
        Bytes::from(out)
    }
    /// The non-streaming response, with `choices` in index order.
    fn response(
        &self,
        choices: Vec<ChoiceOutput>,
        usage: Usage,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Response;
}

/// A fresh response id with the API's prefix.
pub fn response_id(prefix: &str) -> String {
    let id = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    crate::trace::note_response_id(&id);
    id
}
