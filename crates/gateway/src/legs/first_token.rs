//! The first token from prefill: a streamed P/D answer whose first token is the one the
//! prefill worker already computed, sent as soon as the decode worker answers (before its
//! first step), while the decode worker's stream (which generates that token again, as
//! vLLM's does) is relayed without it.
//!
//! - [`eligible`]: whether a request may take it (streamed chat or completions whose
//!   first streamed token is exactly the prefill answer's: no stop strings that could
//!   hold text back, no echo, no prompt logprobs, no `min_tokens`, no tools, no
//!   per-chunk usage);
//! - [`pin_seed`]: a request without a `seed` gets one, the same on both legs, so that a
//!   sampled first token is the one the decode worker draws again;
//! - [`FirstToken::from_answer`]: the token of each choice in the prefill answer (its
//!   text, logprobs, `finish_reason` `length`), or none;
//! - [`FirstTokenGuard`]: on the decode stream, drops the role event and the first token
//!   of each choice when it equals the one sent, and reports any other as a mismatch.

use std::future::{ready, Future};
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use futures::{stream, StreamExt};
use http::{header, HeaderValue};
use pdserve_protocol::sse::data_event;
use serde_json::{json, Map, Value};

use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::ingress::request::ClientRequest;
use crate::legs::sse::StreamDialect;
use crate::serving::{FirstTokenFromPrefill, ServingMetrics};

/// The request field that turns the first token from prefill on or off for one request;
/// the gateway takes it out before forwarding.
pub const REQUEST_FIELD: &str = "first_token_from_prefill";

/// Takes the client's [`REQUEST_FIELD`] out of `request`: `Some(on)` when it was a
/// boolean (any other value is dropped as no choice).
pub fn take_request_choice(request: &mut ClientRequest) -> Option<bool> {
    request
        .extra_mut()
        .remove(REQUEST_FIELD)
        .and_then(|v| v.as_bool())
}

/// Whether `request` (to `endpoint`) takes its first token from the prefill leg, given
/// the gateway's mode and the request's own choice: a stream of chat or completions
/// whose first streamed event carries exactly the token a one-token answer does.
pub fn eligible(
    endpoint: Endpoint,
    request: &ClientRequest,
    mode: FirstTokenFromPrefill,
    choice: Option<bool>,
) -> bool {
    let on = choice.unwrap_or(mode != FirstTokenFromPrefill::Off);
    if !on || !request.is_stream() || endpoint == Endpoint::Responses {
        return false;
    }
    let (generation, extra) = match request {
        ClientRequest::Chat(c) => {
            if c.extra.contains_key("tools") {
                // A tool parser may hold content back, or turn it into tool calls.
                return false;
            }
            (&c.generation, &c.extra)
        }
        ClientRequest::Completion(c) => {
            if c.echo == Some(true) || request.verbatim_number("prompt_logprobs").is_some() {
                return false;
            }
            (&c.generation, &c.extra)
        }
    };
    // Stop strings hold back text that could begin one; the worker's stream would not
    // show the token the one-token answer shows.
    let stops = generation
        .stop
        .as_ref()
        .is_some_and(|s| !s.to_vec().is_empty());
    // The prefill leg has no `min_tokens`: its end-of-sequence is not masked as decode's.
    let min_tokens = generation.min_tokens.is_some_and(|m| m > 0);
    let per_chunk_usage = request
        .transport()
        .stream_options
        .as_ref()
        .and_then(|o| o.extra.get("continuous_usage_stats"))
        .is_some_and(|v| v.as_bool() == Some(true));
    let prompt_logprobs = extra.contains_key("prompt_logprobs");
    !(stops || min_tokens || per_chunk_usage || prompt_logprobs)
}

/// How many choices `request` asks for (`n`, 1 when absent).
pub fn choices(request: &ClientRequest) -> u64 {
    request
        .verbatim_number("n")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Gives a sampled `request` without a `seed` a random one, so that the prefill worker
/// and the decode worker draw the same first token (each choice `i` of `n` then uses
/// `seed + i` on both, as vLLM and pdserve's workers derive it). A greedy request
/// (`temperature` 0) is left alone.
pub fn pin_seed(request: &mut ClientRequest) {
    if request.verbatim_number("seed").is_some() {
        return;
    }
    let greedy = request
        .verbatim_number("temperature")
        .and_then(|t| t.parse::<f64>().ok())
        .is_some_and(|t| t == 0.0);
    if greedy {
        return;
    }
    // Below 2^31: every engine takes it as a plain integer seed.
    let seed = rand::random::<u32>() >> 1;
    request
        .verbatim_numbers_mut()
        .push(("seed".into(), seed.to_string()));
}

/// One choice's first token, as the prefill worker answered it.
#[derive(Debug, Clone, PartialEq)]
struct ChoiceToken {
    index: u64,
    text: String,
    logprobs: Value,
}

/// The first token of every choice, from the prefill answer.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstToken {
    endpoint: Endpoint,
    id: String,
    created: Value,
    model: Value,
    choices: Vec<ChoiceToken>,
}

impl FirstToken {
    /// The first tokens in P's answer `body` to a request for `n` choices: each choice's
    /// text, not empty and with no replacement character (a token cut inside a character
    /// is held back by a stream), and `finish_reason` `length` (the answer did not end
    /// at its first token). `None` when any choice lacks them. The prefill leg asks for
    /// one choice (the gateway sends it `n` = 1): then only choice 0 is led by P's token
    /// (the same seed draws it on both), the others' first tokens come from the decode
    /// worker; an answer with all `n` choices leads every one.
    pub fn from_answer(endpoint: Endpoint, body: &[u8], n: u64) -> Option<Self> {
        let answer: Map<String, Value> = serde_json::from_slice(body).ok()?;
        let id = answer.get("id")?.as_str()?.to_string();
        let list = answer.get("choices")?.as_array()?;
        if list.len() as u64 != n && list.len() != 1 {
            return None;
        }
        let mut choices = Vec::with_capacity(list.len());
        for choice in list {
            let index = choice.get("index")?.as_u64()?;
            if choice.get("finish_reason")?.as_str()? != "length" {
                return None;
            }
            let text = match endpoint {
                Endpoint::Chat => choice.get("message")?.get("content")?.as_str()?,
                Endpoint::Completions => choice.get("text")?.as_str()?,
                Endpoint::Responses => return None,
            };
            if text.is_empty() || text.contains('\u{FFFD}') {
                return None;
            }
            choices.push(ChoiceToken {
                index,
                text: text.to_string(),
                logprobs: choice.get("logprobs").cloned().unwrap_or(Value::Null),
            });
        }
        choices.sort_by_key(|c| c.index);
        if choices.iter().enumerate().any(|(i, c)| c.index != i as u64) {
            return None;
        }
        Some(Self {
            endpoint,
            id,
            created: answer.get("created").cloned().unwrap_or(Value::Null),
            model: answer.get("model").cloned().unwrap_or(Value::Null),
            choices,
        })
    }

    /// The events the client gets at once: per choice, chat's role event then the token;
    /// completions' token.
    pub fn events(&self) -> Bytes {
        let mut out = BytesMut::new();
        for choice in &self.choices {
            match self.endpoint {
                Endpoint::Chat => {
                    let role = json!({"role": "assistant", "content": ""});
                    out.put(data_event(&self.chunk(choice.index, role, &Value::Null)));
                    let delta = json!({"content": choice.text});
                    out.put(data_event(&self.chunk(
                        choice.index,
                        delta,
                        &choice.logprobs,
                    )));
                }
                _ => {
                    let text = Value::String(choice.text.clone());
                    out.put(data_event(&self.chunk(
                        choice.index,
                        text,
                        &choice.logprobs,
                    )));
                }
            }
        }
        out.freeze()
    }

    /// One streamed event of choice `index` carrying `content` (chat's delta, or
    /// completions' text).
    fn chunk(&self, index: u64, content: Value, logprobs: &Value) -> Value {
        let (object, key) = match self.endpoint {
            Endpoint::Chat => ("chat.completion.chunk", "delta"),
            _ => ("text_completion", "text"),
        };
        let mut choice = Map::new();
        choice.insert("index".into(), index.into());
        choice.insert(key.into(), content);
        choice.insert("logprobs".into(), logprobs.clone());
        choice.insert("finish_reason".into(), Value::Null);
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [Value::Object(choice)],
        })
    }
}

/// A streamed answer whose first events are `sent`'s, sent at once, and whose rest is the
/// body of the decode leg `decode` once it answers. A decode leg that fails (after its
/// retries) ends the stream with an OpenAI error event and `[DONE]`, never silently; a
/// client that leaves drops `decode`, and with it whatever it holds (the prefill
/// worker's blocks are released).
pub fn led_from_prefill<F>(sent: &FirstToken, decode: F, metrics: Arc<ServingMetrics>) -> Response
where
    F: Future<Output = Result<Response, Failure>> + Send + 'static,
{
    let head = stream::once(ready(Ok::<Bytes, axum::Error>(sent.events())));
    let rest = stream::once(decode).flat_map(move |answer| match answer {
        Ok(response) => response.into_body().into_data_stream().boxed(),
        Err(failure) => {
            metrics.inc_stream_errors();
            let error = failure.into_api_error();
            tracing::warn!(
                "the decode leg failed after the prefill's first token was sent: {}",
                error.body.error.message
            );
            let tail = StreamDialect::Chat.error_tail(&error, true);
            stream::once(ready(Ok(tail))).boxed()
        }
    });
    let mut response = Response::new(Body::from_stream(head.chain(rest)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// How the decode stream failed to continue from the tokens sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "choice {index}: the prefill worker's first token was {sent:?}, the decode worker's {got:?}"
)]
pub struct Mismatch {
    /// The choice.
    pub index: u64,
    /// The text the client got from the prefill answer.
    pub sent: String,
    /// What the decode worker generated instead (`<end>` when it ended first).
    pub got: String,
}

/// Where a choice stands on the decode stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// The decode worker has not yet generated the first token again.
    Awaiting,
    /// Its first token was dropped: the rest passes.
    Continued,
}

/// Watches one decode stream (one attempt) whose first tokens the client already got.
#[derive(Debug)]
pub struct FirstTokenGuard {
    sent: Arc<FirstToken>,
    progress: Vec<Progress>,
    /// Where the decode stream's id differs from the prefill answer's: its events' head
    /// (`data: {"id":"<decode id>"`) and that head with the prefill answer's id, made
    /// once so that each later event is a prefix swap, not a parse.
    id_swap: Option<(Vec<u8>, Vec<u8>)>,
    /// A dropped event's blank line is still to come.
    skip_blank: bool,
}

impl FirstTokenGuard {
    /// A guard for a decode stream that must continue from `sent`.
    pub fn new(sent: Arc<FirstToken>) -> Self {
        let progress = vec![Progress::Awaiting; sent.choices.len()];
        Self {
            sent,
            progress,
            id_swap: None,
            skip_blank: false,
        }
    }

    /// Whether every choice has continued from its token.
    fn settled(&self) -> bool {
        self.progress.iter().all(|p| *p == Progress::Continued)
    }

    /// Whole lines of the decode stream, as the client gets them: the role events and
    /// the first token of each choice taken out, the stream's id made the prefill
    /// answer's.
    pub fn filter(&mut self, lines: Bytes) -> Result<Bytes, Mismatch> {
        if self.settled() && !self.skip_blank && self.id_swap.is_none() {
            return Ok(lines);
        }
        let mut out = BytesMut::with_capacity(lines.len());
        for line in lines.split_inclusive(|&b| b == b'\n') {
            let bare = line.strip_suffix(b"\n").unwrap_or(line);
            let bare = bare.strip_suffix(b"\r").unwrap_or(bare);
            if std::mem::take(&mut self.skip_blank) && bare.is_empty() {
                continue;
            }
            let Some(data) = bare.strip_prefix(b"data:") else {
                out.put(line);
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            if data == b"[DONE]" {
                if let Some(index) = self.progress.iter().position(|p| *p == Progress::Awaiting) {
                    return Err(self.mismatch(index as u64, "<end>".into()));
                }
                out.put(line);
                continue;
            }
            if self.settled() {
                self.put_with_prefill_id(&mut out, line);
                continue;
            }
            match self.edit(data)? {
                Edit::Keep => self.put_with_prefill_id(&mut out, line),
                Edit::Drop => self.skip_blank = true,
                Edit::Replace(event) => {
                    out.put(&b"data: "[..]);
                    out.put(&event[..]);
                    out.put(&b"\n"[..]);
                }
            }
        }
        Ok(out.freeze())
    }

    /// Writes `line` to `out`, the decode stream's id at its start replaced by the
    /// prefill answer's.
    fn put_with_prefill_id(&self, out: &mut BytesMut, line: &[u8]) {
        let swapped = self
            .id_swap
            .as_ref()
            .and_then(|(head, prefill)| Some((prefill, line.strip_prefix(&head[..])?)));
        match swapped {
            Some((prefill, rest)) => {
                out.put(&prefill[..]);
                out.put(rest);
            }
            None => out.put(line),
        }
    }

    /// What becomes of one event while a choice still awaits its first token.
    fn edit(&mut self, data: &[u8]) -> Result<Edit, Mismatch> {
        let Ok(Value::Object(mut event)) = serde_json::from_slice::<Value>(data) else {
            return Ok(Edit::Keep);
        };
        if event.contains_key("error") {
            return Ok(Edit::Keep);
        }
        let Some(Value::Array(choices)) = event.get_mut("choices") else {
            return Ok(Edit::Keep);
        };
        if choices.is_empty() {
            // The usage event.
            return Ok(Edit::Keep);
        }
        let mut kept = Vec::with_capacity(choices.len());
        let mut changed = false;
        for mut choice in std::mem::take(choices) {
            match self.edit_choice(&mut choice)? {
                Edit::Keep => kept.push(choice),
                Edit::Drop => changed = true,
                Edit::Replace(_) => {
                    changed = true;
                    kept.push(choice);
                }
            }
        }
        if let Some(id) = event.get("id").and_then(Value::as_str) {
            if id != self.sent.id {
                if self.id_swap.is_none() {
                    let head = format!("data: {{\"id\":\"{id}\"").into_bytes();
                    let prefill = format!("data: {{\"id\":{}", json!(self.sent.id)).into_bytes();
                    self.id_swap = Some((head, prefill));
                }
                event.insert("id".into(), Value::String(self.sent.id.clone()));
                changed = true;
            }
        }
        if kept.is_empty() {
            return Ok(Edit::Drop);
        }
        if !changed {
            return Ok(Edit::Keep);
        }
        event.insert("choices".into(), Value::Array(kept));
        let bytes = serde_json::to_vec(&event).unwrap_or_default();
        Ok(Edit::Replace(bytes))
    }

    /// One choice of an event: `Drop` (it said nothing else), `Replace` (edited in
    /// place) or `Keep`.
    fn edit_choice(&mut self, choice: &mut Value) -> Result<Edit, Mismatch> {
        let Some(index) = choice.get("index").and_then(Value::as_u64) else {
            return Ok(Edit::Keep);
        };
        let at = index as usize;
        if self.progress.get(at) != Some(&Progress::Awaiting) {
            return Ok(Edit::Keep);
        }
        let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let chat = self.sent.endpoint == Endpoint::Chat;
        let mut changed = false;
        let text = if chat {
            let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                return Ok(Edit::Keep);
            };
            // The role event was sent with the token.
            changed |= delta.remove("role").is_some();
            delta
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        } else {
            choice
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let sent = &self.sent.choices[at].text;
        if text.is_empty() {
            if finished {
                return Err(self.mismatch(index, "<end>".into()));
            }
            let delta_empty = !chat
                || choice
                    .get("delta")
                    .and_then(Value::as_object)
                    .is_none_or(|d| d.keys().all(|k| k == "content"));
            return Ok(if delta_empty {
                Edit::Drop
            } else if changed {
                Edit::Replace(Vec::new())
            } else {
                Edit::Keep
            });
        }
        let Some(rest) = text.strip_prefix(sent.as_str()) else {
            return Err(self.mismatch(index, text));
        };
        self.progress[at] = Progress::Continued;
        if rest.is_empty() && !finished {
            return Ok(Edit::Drop);
        }
        let rest = Value::String(rest.to_string());
        if chat {
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                if rest.as_str() == Some("") {
                    delta.remove("content");
                } else {
                    delta.insert("content".into(), rest.clone());
                }
            }
        } else if let Some(obj) = choice.as_object_mut() {
            obj.insert("text".into(), rest.clone());
        }
        drop_first_logprob(choice, chat, rest.as_str() == Some(""));
        Ok(Edit::Replace(Vec::new()))
    }

    fn mismatch(&self, index: u64, got: String) -> Mismatch {
        Mismatch {
            index,
            sent: self
                .sent
                .choices
                .get(index as usize)
                .map(|c| c.text.clone())
                .unwrap_or_default(),
            got,
        }
    }
}

/// What the guard does with an event or a choice.
enum Edit {
    Keep,
    Drop,
    /// An event's new JSON (a choice's edit carries none: it was edited in place).
    Replace(Vec<u8>),
}

/// Takes the first token's entry out of a choice's `logprobs` (it was sent with the
/// prefill's token); `none_left`: the choice carries no token now, its logprobs `null`.
fn drop_first_logprob(choice: &mut Value, chat: bool, none_left: bool) {
    let Some(logprobs) = choice.get_mut("logprobs") else {
        return;
    };
    if logprobs.is_null() {
        return;
    }
    if none_left {
        *logprobs = Value::Null;
        return;
    }
    let lists: &[&str] = if chat {
        &["content"]
    } else {
        &["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    };
    for key in lists {
        if let Some(Value::Array(list)) = logprobs.get_mut(*key) {
            if !list.is_empty() {
                list.remove(0);
            }
        }
    }
}

#[cfg(test)]
#[path = "first_token_tests.rs"]
mod tests;
