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
//! - [`led_from_prefill`]: the answer sent at once, the decode leg finishing inside its
//!   body;
//! - the guard on the decode stream: [`crate::legs::first_token_guard`]; P's token taken
//!   from a streamed prefill answer: [`crate::legs::first_token_watch`].

use std::future::{ready, Future};
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use futures::{stream, StreamExt};
use http::{header, HeaderValue};
use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::ingress::request::ClientRequest;
use crate::legs::sse::StreamDialect;
use crate::observe::journey::Journey;
use crate::observe::request_record::Finished;
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
#[derive(Debug, Clone)]
pub(super) struct ChoiceToken {
    pub(super) index: u64,
    pub(super) text: String,
    /// Its `logprobs`, as the worker wrote them (JSON).
    logprobs: Box<RawValue>,
}

/// The first token of every choice, from the prefill answer.
#[derive(Debug, Clone)]
pub struct FirstToken {
    pub(super) endpoint: Endpoint,
    pub(super) id: String,
    /// `created` and `model` as the worker wrote them (JSON).
    created: Box<RawValue>,
    model: Box<RawValue>,
    pub(super) choices: Vec<ChoiceToken>,
}

impl PartialEq for FirstToken {
    fn eq(&self, other: &Self) -> bool {
        self.endpoint == other.endpoint
            && self.id == other.id
            && self.created.get() == other.created.get()
            && self.model.get() == other.model.get()
            && self.choices == other.choices
    }
}

impl PartialEq for ChoiceToken {
    fn eq(&self, other: &Self) -> bool {
        self.index == other.index
            && self.text == other.text
            && self.logprobs.get() == other.logprobs.get()
    }
}

/// A prefill answer's fields the first token is made of; the rest is skipped unbuilt.
#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(default, borrow)]
    created: Option<&'a RawValue>,
    #[serde(default, borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    choices: Vec<AnswerChoice<'a>>,
}

#[derive(Deserialize)]
struct AnswerChoice<'a> {
    index: u64,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    message: Option<AnswerMessage<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    logprobs: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct AnswerMessage<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

/// One streamed event as the client gets it from the gateway.
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: &'a RawValue,
    model: &'a RawValue,
    choices: [ChunkChoice<'a>; 1],
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: &'a RawValue,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

/// JSON `null`.
fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

/// `value` as raw JSON (`null` when absent).
fn raw(value: Option<&Value>) -> Box<RawValue> {
    value
        .and_then(|v| serde_json::value::to_raw_value(v).ok())
        .unwrap_or_else(null)
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
        if !body.trim_ascii_start().starts_with(b"{") {
            return None;
        }
        let answer: Answer = serde_json::from_slice(body).ok()?;
        if answer.choices.len() as u64 != n && answer.choices.len() != 1 {
            return None;
        }
        let mut choices = Vec::with_capacity(answer.choices.len());
        for choice in answer.choices {
            if choice.finish_reason.as_deref() != Some("length") {
                return None;
            }
            let text = match endpoint {
                Endpoint::Chat => choice.message?.content?,
                Endpoint::Completions => choice.text?,
                Endpoint::Responses => return None,
            };
            if text.is_empty() || text.contains('\u{FFFD}') {
                return None;
            }
            choices.push(ChoiceToken {
                index: choice.index,
                text: text.into_owned(),
                logprobs: choice.logprobs.map_or_else(null, RawValue::to_owned),
            });
        }
        choices.sort_by_key(|c| c.index);
        if choices.iter().enumerate().any(|(i, c)| c.index != i as u64) {
            return None;
        }
        Some(Self {
            endpoint,
            id: answer.id.into_owned(),
            created: answer.created.map_or_else(null, RawValue::to_owned),
            model: answer.model.map_or_else(null, RawValue::to_owned),
            choices,
        })
    }

    /// What one event of P's streamed answer (its `data:` JSON) says about choice 0's
    /// first token: the token (text not empty, not cut inside a character, the choice
    /// not ended other than by `length`), nothing yet (the role event, an empty delta),
    /// or that the stream cannot lead (an error, another choice, an end before a token).
    pub fn from_event(endpoint: Endpoint, data: &[u8]) -> EventToken {
        let Ok(Value::Object(event)) = serde_json::from_slice::<Value>(data) else {
            return EventToken::Never;
        };
        if event.get("error").is_some_and(|e| !e.is_null()) {
            return EventToken::Never;
        }
        let Some(choices) = event.get("choices").and_then(Value::as_array) else {
            return EventToken::Never;
        };
        // One choice per event until the first token (the usage event, which has none,
        // comes last).
        let [choice] = choices.as_slice() else {
            return EventToken::Never;
        };
        if choice.get("index").and_then(Value::as_u64) != Some(0) {
            return EventToken::Never;
        }
        let text = match endpoint {
            Endpoint::Chat => choice.pointer("/delta/content").and_then(Value::as_str),
            Endpoint::Completions => choice.get("text").and_then(Value::as_str),
            Endpoint::Responses => return EventToken::Never,
        };
        let finish = choice.get("finish_reason").and_then(Value::as_str);
        let text = text.unwrap_or("");
        if text.is_empty() {
            return if finish.is_some() {
                EventToken::Never
            } else {
                EventToken::NotYet
            };
        }
        if text.contains('\u{FFFD}') || finish.is_some_and(|f| f != "length") {
            return EventToken::Never;
        }
        EventToken::Token(Self {
            endpoint,
            id: event
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            created: raw(event.get("created")),
            model: raw(event.get("model")),
            choices: vec![ChoiceToken {
                index: 0,
                text: text.to_string(),
                logprobs: raw(choice.get("logprobs")),
            }],
        })
    }

    /// The events the client gets at once: per choice, chat's role event then the token;
    /// completions' token.
    pub fn events(&self) -> Bytes {
        let mut out = BytesMut::new();
        let none = null();
        for choice in &self.choices {
            match self.endpoint {
                Endpoint::Chat => {
                    let role = Delta {
                        role: Some("assistant"),
                        content: "",
                    };
                    self.put_event(&mut out, choice.index, Some(role), None, &none);
                    let token = Delta {
                        role: None,
                        content: &choice.text,
                    };
                    self.put_event(&mut out, choice.index, Some(token), None, &choice.logprobs);
                }
                _ => {
                    let text = Some(choice.text.as_str());
                    self.put_event(&mut out, choice.index, None, text, &choice.logprobs);
                }
            }
        }
        out.freeze()
    }

    /// Writes one streamed event of choice `index` (chat's `delta`, or completions'
    /// `text`) to `out`.
    fn put_event(
        &self,
        out: &mut BytesMut,
        index: u64,
        delta: Option<Delta<'_>>,
        text: Option<&str>,
        logprobs: &RawValue,
    ) {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        let chunk = Chunk {
            id: &self.id,
            object,
            created: &self.created,
            model: &self.model,
            choices: [ChunkChoice {
                index,
                delta,
                text,
                logprobs,
                finish_reason: None,
            }],
        };
        out.put(&b"data: "[..]);
        let mut writer = out.writer();
        // Serializing these borrowed fields cannot fail.
        let _ = serde_json::to_writer(&mut writer, &chunk);
        let out = writer.into_inner();
        out.put(&b"\n\n"[..]);
    }
}

/// A streamed answer whose first events are `sent`'s, sent at once, and whose rest is the
/// body of the decode leg `decode` once it answers. A decode leg that fails (after its
/// retries) ends the stream with an OpenAI error event and `[DONE]`, never silently; a
/// client that leaves drops `decode`, and with it whatever it holds (the prefill
/// worker's blocks are released). The request's `journey` is filed as a stream: by the
/// decode leg's relay when it answers, else here (its failure, or the client leaving
/// before it answered).
pub fn led_from_prefill<F>(
    sent: &FirstToken,
    decode: F,
    metrics: Arc<ServingMetrics>,
    journey: Arc<Journey>,
) -> Response
where
    F: Future<Output = Result<Response, Failure>> + Send + 'static,
{
    journey.relay_takes_over();
    let events = sent.events();
    let leading = journey.clone();
    let head = stream::once(async move {
        leading.first_byte_sent();
        Ok::<Bytes, axum::Error>(events)
    });
    let filing = LedFiling {
        journey,
        metrics: metrics.clone(),
    };
    let rest = stream::once(decode).flat_map(move |answer| match answer {
        Ok(response) => response.into_body().into_data_stream().boxed(),
        Err(failure) => {
            metrics.inc_stream_errors();
            let error = failure.into_api_error();
            tracing::warn!(
                "the decode leg failed after the prefill's first token was sent: {}",
                error.body.error.message
            );
            filing.file(error.status.as_u16(), "stream_error");
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

/// Files a led stream that no decode relay filed: on a failed decode leg, or when the
/// body is dropped first (the client left; a filed journey ignores the late call).
struct LedFiling {
    journey: Arc<Journey>,
    metrics: Arc<ServingMetrics>,
}

impl LedFiling {
    fn file(&self, status: u16, outcome: &'static str) {
        let started = self.journey.started();
        self.journey.file(
            self.metrics.history(),
            Finished {
                status,
                outcome,
                stream: true,
                ttft: self
                    .journey
                    .first_byte()
                    .map(|t| t.saturating_duration_since(started)),
                itl: None,
                duration: started.elapsed(),
            },
        );
    }
}

impl Drop for LedFiling {
    fn drop(&mut self) {
        // nginx's "client closed request"; a no-op once the relay or a failure filed it.
        self.file(499, "client_left");
    }
}

/// What an event of P's streamed answer says about its first token.
#[derive(Debug)]
pub enum EventToken {
    /// Choice 0's first token.
    Token(FirstToken),
    /// Nothing yet: read on.
    NotYet,
    /// This stream will not lead the answer.
    Never,
}
