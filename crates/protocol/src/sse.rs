//! Server-sent events as OpenAI streams use them: `data: {json}` events ended by
//! `data: [DONE]`. Parsing is delegated to `eventsource-stream`.

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures::{Stream, StreamExt};
use serde::Serialize;

/// The terminating event of an OpenAI stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// One `data:` event carrying `value` as JSON.
pub fn data_event<T: Serialize>(value: &T) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing our own types cannot fail; fall back to `null` rather than panic.
    serde_json::to_writer(&mut out, value).unwrap_or_else(|_| out.extend_from_slice(b"null"));
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// A message read from an OpenAI stream.
#[derive(Debug, Clone, PartialEq)]
pub enum SseMessage {
    /// The `data` of one event (usually a JSON chunk).
    Data(String),
    /// `data: [DONE]`.
    Done,
}

/// Why an event stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SseError<E: std::error::Error> {
    #[error("transport error: {0}")]
    Transport(E),
    #[error("invalid UTF-8 in event stream: {0}")]
    Utf8(String),
    #[error("malformed event stream: {0}")]
    Parse(String),
}

/// Reads OpenAI stream messages from a byte stream (e.g. a `reqwest` response body).
/// Events without data (comments, keep-alives) are skipped.
pub fn messages<S, E>(bytes: S) -> impl Stream<Item = Result<SseMessage, SseError<E>>>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: std::error::Error,
{
    bytes.eventsource().filter_map(|ev| async move {
        match ev {
            Ok(ev) if ev.data.is_empty() => None,
            Ok(ev) if ev.data.trim() == "[DONE]" => Some(Ok(SseMessage::Done)),
            Ok(ev) => Some(Ok(SseMessage::Data(ev.data))),
            Err(eventsource_stream::EventStreamError::Transport(e)) => {
                Some(Err(SseError::Transport(e)))
            }
            Err(eventsource_stream::EventStreamError::Utf8(e)) => {
                Some(Err(SseError::Utf8(e.to_string())))
            }
            Err(eventsource_stream::EventStreamError::Parser(e)) => {
                Some(Err(SseError::Parse(e.to_string())))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn reads_events_split_across_chunks() {
        let parts: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from_static(b": keep-alive\n\ndata: {\"a\"")),
            Ok(Bytes::from_static(b":1}\n\n")),
            Ok(data_event(&json!({"b": 2}))),
            Ok(Bytes::from_static(DONE)),
        ];
        let got: Vec<_> = messages(futures::stream::iter(parts))
            .map(|m| m.unwrap())
            .collect()
            .await;
        assert_eq!(
            got,
            vec![
                SseMessage::Data("{\"a\":1}".into()),
                SseMessage::Data("{\"b\":2}".into()),
                SseMessage::Done
            ]
        );
    }
}
