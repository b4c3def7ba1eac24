//! The SSE side of relaying: the stream dialects and their end markers, the scanner
//! that forwards whole lines while it watches for the end and the KV handle, and the
//! edits made to bodies and events on the way (the KV handle taken out, cached tokens
//! written into usage, Responses objects edited).

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use pdserve_protocol::sse::{data_event, DONE};
use pdserve_protocol::{ApiError, KvTransferParams};
use serde_json::Value;

use crate::sessions::conversation::ConversationCache;

/// How a stream ends and says it failed: the chat and completions dialect (`[DONE]`,
/// `data: {"error": ...}`) or the Responses API's (typed events).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamDialect {
    /// `/v1/chat/completions`, `/v1/completions`, SGLang's `/generate`.
    #[default]
    Chat,
    /// `/v1/responses`.
    Responses,
}

/// The Responses events that end a stream.
const TERMINAL_RESPONSE_EVENTS: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

impl StreamDialect {
    /// Where the event that ends the stream starts in `chunk`: the `data: [DONE]` line, or
    /// the first line (`event:` or `data:`) of a terminal Responses event.
    pub fn end_at(self, chunk: &[u8]) -> Option<usize> {
        let mut start = 0;
        for line in chunk.split(|&b| b == b'\n') {
            let at = start;
            start += line.len() + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let ends = match self {
                Self::Chat => data_of(line) == Some(b"[DONE]"),
                Self::Responses => {
                    let named = line
                        .strip_prefix(b"event:")
                        .map(|name| name.trim_ascii())
                        .is_some_and(|name| {
                            TERMINAL_RESPONSE_EVENTS
                                .iter()
                                .any(|t| t.as_bytes() == name)
                        });
                    named || data_of(line).is_some_and(is_terminal_response_event)
                }
            };
            if ends {
                return Some(at);
            }
        }
        None
    }

    /// The events that end a stream with `error`, after whatever was sent (`at_boundary`:
    /// that ended at an event boundary).
    pub fn error_tail(self, error: &ApiError, at_boundary: bool) -> Bytes {
        let mut out = BytesMut::new();
        if !at_boundary {
            out.extend_from_slice(b"\n");
        }
        match self {
            Self::Chat => {
                out.extend_from_slice(&data_event(&error.to_json()));
                out.extend_from_slice(DONE);
            }
            Self::Responses => {
                // OpenAI's `error` stream event; nothing follows it.
                let event = serde_json::json!({
                    "type": "error",
                    "code": error.body.error.code.clone().unwrap_or_else(|| error.body.error.kind.clone().into()),
                    "message": error.body.error.message,
                    "param": error.body.error.param,
                    "sequence_number": 0,
                });
                out.extend_from_slice(b"event: error\n");
                out.extend_from_slice(&data_event(&event));
            }
        }
        out.freeze()
    }
}

/// Whether an event's JSON is a terminal Responses event (by its `type`).
fn is_terminal_response_event(data: &[u8]) -> bool {
    TERMINAL_RESPONSE_EVENTS.iter().any(|t| {
        contains(data, format!("\"type\":\"{t}\"").as_bytes())
            || contains(data, format!("\"type\": \"{t}\"").as_bytes())
    })
}

/// What a Responses answer's response objects go through before the client sees them:
/// the gateway's facts written in, and the finished one kept for the next turn.
pub trait ResponseObjects: Send + Sync {
    /// Edits a `response` object (a non-stream body, or the one a stream event carries)
    /// that `worker` (its base URL) answered; `kv` is the handle taken out of it,
    /// `finished` whether the response is done.
    fn edit(
        &self,
        response: &mut Value,
        kv: Option<KvTransferParams>,
        finished: bool,
        worker: &str,
    );

    /// Waits until the finished response is kept: the client's last bytes wait for it,
    /// so a next turn, on any gateway replica, finds the turn it continues.
    fn flush(&self) -> futures::future::BoxFuture<'_, ()>;
}

/// Where what an answer says about the conversation's next turn goes.
#[derive(Clone)]
pub enum AnswerSink {
    /// A request that named a `conversation_id`: D's final KV handle is kept for it.
    Conversation {
        /// The cache.
        cache: Arc<ConversationCache>,
        /// The conversation.
        id: String,
    },
    /// A Responses answer: its response objects are edited, the finished one kept.
    Responses(Arc<dyn ResponseObjects>),
}

/// A non-stream Responses body with `objects` applied to it (its `kv_transfer_params`
/// taken out first); a body that is not a JSON object passes unchanged.
pub fn edit_response_body(body: Bytes, objects: &dyn ResponseObjects, worker: &str) -> Bytes {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let kv = take_kv(&mut map);
    let mut value = Value::Object(map);
    objects.edit(&mut value, kv, true, worker);
    serde_json::to_vec(&value).map_or(body, Bytes::from)
}

/// Removes `kv_transfer_params` from `map`; the handle, if it was one.
fn take_kv(map: &mut serde_json::Map<String, Value>) -> Option<KvTransferParams> {
    map.remove("kv_transfer_params")
        .filter(|kv| !kv.is_null())
        .and_then(|kv| serde_json::from_value(kv).ok())
}

/// A partial line longer than this means the upstream is not sending SSE.
const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// Splits a byte stream at line boundaries and inspects each complete line.
///
/// Only complete lines are forwarded, so that an error event appended after an upstream
/// failure never lands inside a half-forwarded event.
#[derive(Debug, Default)]
pub struct SseScanner {
    tail: BytesMut,
    /// `data: [DONE]` was seen.
    pub saw_done: bool,
    /// Look for `kv_transfer_params` in events (only when a conversation needs them).
    pub capture_kv: bool,
    /// The last `kv_transfer_params` seen in an event.
    pub kv: Option<KvTransferParams>,
    /// Whether everything forwarded so far ends at an event boundary (blank line).
    at_event_boundary: bool,
    /// The stream's dialect.
    dialect: StreamDialect,
    /// Where a Responses stream's response objects are edited.
    objects: Option<Arc<dyn ResponseObjects>>,
    /// The base URL of the worker whose stream this is.
    worker: String,
}

impl std::fmt::Debug for dyn ResponseObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseObjects")
    }
}

impl SseScanner {
    /// A scanner; `capture_kv` turns on parsing of events that carry KV params.
    pub fn new(capture_kv: bool) -> Self {
        Self {
            capture_kv,
            at_event_boundary: true,
            ..Self::default()
        }
    }

    /// A scanner of `worker`'s Responses stream, whose response objects go through
    /// `objects`.
    pub fn responses(objects: Option<Arc<dyn ResponseObjects>>, worker: String) -> Self {
        Self {
            at_event_boundary: true,
            dialect: StreamDialect::Responses,
            objects,
            worker,
            ..Self::default()
        }
    }

    /// Takes in one upstream chunk; returns the complete lines to forward now.
    pub fn push(&mut self, chunk: Bytes) -> Result<Option<Bytes>, String> {
        let ready = if self.tail.is_empty() {
            match chunk.iter().rposition(|&b| b == b'\n') {
                // The common case: the worker wrote whole events; forward without copying.
                Some(i) if i + 1 == chunk.len() => Some(chunk),
                Some(i) => {
                    self.tail.extend_from_slice(&chunk[i + 1..]);
                    Some(chunk.slice(..=i))
                }
                None => {
                    self.tail.extend_from_slice(&chunk);
                    None
                }
            }
        } else {
            self.tail.extend_from_slice(&chunk);
            self.tail
                .iter()
                .rposition(|&b| b == b'\n')
                .map(|i| self.tail.split_to(i + 1).freeze())
        };
        if self.tail.len() > MAX_LINE_BYTES {
            return Err(format!("an event line exceeded {MAX_LINE_BYTES} bytes"));
        }
        let Some(lines) = ready else {
            return Ok(None);
        };
        self.at_event_boundary = lines.ends_with(b"\n\n") || lines.ends_with(b"\r\n\r\n");
        if self.dialect == StreamDialect::Responses {
            return Ok(Some(self.edit_responses(lines)));
        }
        // Only events that name KV params are rewritten; everything else passes as is.
        if contains(&lines, KV_FIELD) {
            return Ok(Some(self.strip_kv(&lines)));
        }
        self.saw_done |= contains(&lines, b"[DONE]") && self.scan_done(&lines);
        Ok(Some(lines))
    }

    fn scan_done(&self, lines: &[u8]) -> bool {
        lines
            .split(|&b| b == b'\n')
            .any(|line| data_of(line) == Some(b"[DONE]"))
    }

    /// Takes the decode side's KV handle out of every event that carries one (kept for
    /// the conversation's next turn when asked, never shown to the client: it names
    /// internal hosts, ports and block ids).
    fn strip_kv(&mut self, lines: &[u8]) -> Bytes {
        rewrite_events(lines, 0, |data| match data {
            b"[DONE]" => {
                self.saw_done = true;
                None
            }
            data if contains(data, KV_FIELD) => self.without_kv(data),
            _ => None,
        })
    }

    /// The event's JSON without `kv_transfer_params` (captured first when asked).
    fn without_kv(&mut self, data: &[u8]) -> Option<Vec<u8>> {
        let mut value: Value = serde_json::from_slice(data).ok()?;
        let kv = value.as_object_mut()?.remove("kv_transfer_params")?;
        if self.capture_kv && !kv.is_null() {
            if let Ok(kv) = serde_json::from_value(kv) {
                self.kv = Some(kv);
            }
        }
        serde_json::to_vec(&value).ok()
    }

    /// A Responses stream's lines: the events that carry a response object (created,
    /// in progress, the terminal one) lose its `kv_transfer_params` and go through the
    /// edits; the terminal one ends the stream.
    fn edit_responses(&mut self, lines: Bytes) -> Bytes {
        if !contains(&lines, b"\"response\":") && !contains(&lines, KV_FIELD) {
            return lines;
        }
        let objects = self.objects.clone();
        let worker = std::mem::take(&mut self.worker);
        let mut ended = false;
        let edited = rewrite_events(&lines, 64, |data| {
            let mut value: Value = serde_json::from_slice(data).ok()?;
            let finished = value
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| TERMINAL_RESPONSE_EVENTS.contains(&t));
            ended |= finished;
            let response = value.get_mut("response")?.as_object_mut()?;
            let kv = take_kv(response);
            if let Some(objects) = &objects {
                objects.edit(value.get_mut("response")?, kv, finished, &worker);
            }
            serde_json::to_vec(&value).ok()
        });
        self.worker = worker;
        if ended || self.dialect.end_at(&lines).is_some() {
            self.saw_done = true;
        }
        edited
    }

    /// An error event (and, for chat, the end marker), separated from anything forwarded
    /// before.
    /// The stream's dialect.
    pub fn dialect(&self) -> StreamDialect {
        self.dialect
    }

    pub fn error_tail(&self, error: &ApiError) -> Bytes {
        self.dialect.error_tail(error, self.at_event_boundary)
    }
}

/// The key an event carries a KV handle under.
const KV_FIELD: &[u8] = b"\"kv_transfer_params\"";

/// Whether `needle` occurs in `haystack` (SIMD search: every relayed chunk is checked).
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(haystack, needle).is_some()
}

/// The payload of an SSE `data:` line (without the `\r` of a CRLF line end).
fn data_of(line: &[u8]) -> Option<&[u8]> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let data = line.strip_prefix(b"data:")?;
    Some(data.strip_prefix(b" ").unwrap_or(data))
}

/// Whole SSE `lines` with each `data:` event's payload replaced by what `edit` returns
/// for it (`None` keeps the line as it came); line endings are kept. `extra` is the
/// growth to reserve.
pub(crate) fn rewrite_events(
    lines: &[u8],
    extra: usize,
    mut edit: impl FnMut(&[u8]) -> Option<Vec<u8>>,
) -> Bytes {
    let mut out = BytesMut::with_capacity(lines.len() + extra);
    let mut pieces = lines.split(|&b| b == b'\n').peekable();
    while let Some(line) = pieces.next() {
        match data_of(line).and_then(&mut edit) {
            Some(json) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&json);
                if line.ends_with(b"\r") {
                    out.extend_from_slice(b"\r");
                }
            }
            None => out.extend_from_slice(line),
        }
        if pieces.peek().is_some() {
            out.extend_from_slice(b"\n");
        }
    }
    out.freeze()
}

/// A JSON response body without its top-level `kv_transfer_params`, and that handle.
pub fn split_kv_params(body: Bytes) -> (Bytes, Option<KvTransferParams>) {
    if !contains(&body, KV_FIELD) {
        return (body, None);
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return (body, None);
    };
    let Some(kv) = value
        .as_object_mut()
        .and_then(|o| o.remove("kv_transfer_params"))
    else {
        return (body, None);
    };
    let kv = if kv.is_null() {
        None
    } else {
        serde_json::from_value(kv).ok()
    };
    match serde_json::to_vec(&value) {
        Ok(stripped) => (Bytes::from(stripped), kv),
        Err(_) => (body, kv),
    }
}

/// A JSON body with `usage.prompt_tokens_details.cached_tokens` set to `cached`, when it
/// has a `usage` object (`None`: leave the body as it is).
pub fn with_cached_tokens(json: &[u8], cached: u64) -> Option<Vec<u8>> {
    if !contains(json, b"\"usage\"") {
        return None;
    }
    let mut value: Value = serde_json::from_slice(json).ok()?;
    let usage = value.get_mut("usage")?.as_object_mut()?;
    let details = usage.entry("prompt_tokens_details").or_insert(Value::Null);
    if !details.is_object() {
        *details = Value::Object(serde_json::Map::new());
    }
    details["cached_tokens"] = Value::from(cached);
    serde_json::to_vec(&value).ok()
}

/// Relayed SSE bytes (whole lines) with `cached` set in every event that reports usage;
/// other chunks pass without a copy.
pub fn stream_with_cached_tokens(chunk: Bytes, cached: u64) -> Bytes {
    if !contains(&chunk, b"\"prompt_tokens\"") {
        return chunk;
    }
    rewrite_events(&chunk, 32, |data| with_cached_tokens(data, cached))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_whole_lines_and_sees_done_and_kv() {
        let mut s = SseScanner::new(true);
        let a = s
            .push(Bytes::from_static(b"data: {\"a\":1}\n\ndata: {\"kv_trans"))
            .unwrap();
        assert_eq!(a.unwrap(), Bytes::from_static(b"data: {\"a\":1}\n\n"));
        assert!(s.kv.is_none());
        let b = s
            .push(Bytes::from_static(
                b"fer_params\":{\"do_remote_prefill\":true,\"remote_port\":7}}\n\ndata: [DONE]\n\n",
            ))
            .unwrap()
            .unwrap();
        assert!(b.starts_with(b"data: {}\n\n"), "{b:?}");
        assert!(
            !contains(&b, KV_FIELD),
            "the handle never reaches the client"
        );
        assert_eq!(s.kv.as_ref().unwrap().remote_port, Some(7));
        assert!(s.saw_done);
    }

    #[test]
    fn kv_params_are_removed_from_every_event_and_body() {
        let mut s = SseScanner::new(false);
        let out = s
            .push(Bytes::from_static(
                b"data: {\"id\":\"x\",\"kv_transfer_params\":{\"remote_host\":\"127.0.0.1\"}}\r\n\r\ndata: [DONE]\r\n\r\n",
            ))
            .unwrap()
            .unwrap();
        assert_eq!(
            out,
            Bytes::from_static(b"data: {\"id\":\"x\"}\r\n\r\ndata: [DONE]\r\n\r\n")
        );
        assert!(s.saw_done && s.kv.is_none());
        let (body, kv) = split_kv_params(Bytes::from_static(
            br#"{"id":"x","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_port":7}}"#,
        ));
        assert_eq!(body, Bytes::from_static(br#"{"id":"x","choices":[]}"#));
        assert_eq!(kv.unwrap().remote_port, Some(7));
        let untouched = Bytes::from_static(br#"{"id":"y"}"#);
        assert_eq!(split_kv_params(untouched.clone()), (untouched, None));
    }

    #[test]
    fn cached_tokens_are_set_in_usage_only() {
        let body = with_cached_tokens(
            br#"{"id":"x","usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":null}}"#,
            4,
        )
        .unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
        assert_eq!(body["usage"]["prompt_tokens"], 9);
        assert!(with_cached_tokens(br#"{"id":"x"}"#, 4).is_none());
        let plain = Bytes::from_static(b"data: {\"choices\":[]}\n\n");
        assert_eq!(stream_with_cached_tokens(plain.clone(), 4), plain);
        let out = stream_with_cached_tokens(
            Bytes::from_static(
                b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\ndata: [DONE]\n\n",
            ),
            4,
        );
        assert_eq!(
            out,
            Bytes::from_static(
                b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n"
            )
        );
    }

    #[test]
    fn error_tail_starts_a_new_event() {
        let mut s = SseScanner::new(false);
        s.push(Bytes::from_static(b"data: {\"a\":1}\n")).unwrap();
        let tail = s.error_tail(&ApiError::bad_gateway("x"));
        assert!(tail.starts_with(b"\ndata: {\"error\""));
        assert!(tail.ends_with(DONE));
    }
}
