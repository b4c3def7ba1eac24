//! One turn over OpenAI's Responses API (`POST /v1/responses`), streamed and timed the
//! way `client.rs` times chat, for `multi-turn --api responses`.
//!
//! A turn sends only its new user message and `previous_response_id`: the server holds
//! the conversation. The stream is SSE with `event: <type>` and `data: {"type": ...}`;
//! `response.created` names the response, every non-empty `response.output_text.delta`
//! is a content chunk (TTFT is the first, ITL the gaps between them), and
//! `response.completed` or `response.incomplete` (the length limit was reached) ends it
//! with the usage. An `error` event or `response.failed` is a failure. There is no
//! `data: [DONE]`.

use std::time::Duration;

use eventsource_stream::{EventStreamError, Eventsource};
use futures::StreamExt;
use pdserve_protocol::{PromptTokensDetails, Usage};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::client::{
    error_chain, event_error_message, snippet, ApiClient, RequestError, StreamRecord,
};

/// The Responses endpoint under the server's base URL.
pub const RESPONSES_PATH: &str = "/v1/responses";

/// What one turn of a Responses conversation sends.
#[derive(Debug, Clone, Copy)]
pub struct ResponsesTurn<'a> {
    /// Model to ask for.
    pub model: &'a str,
    /// The new user message (the only input: earlier turns live on the server).
    pub user: &'a str,
    /// The system prompt; sent every turn, since the API does not carry it over.
    pub instructions: Option<&'a str>,
    /// The id of the previous turn's response; `None` on the first turn.
    pub previous_response_id: Option<&'a str>,
    /// `max_output_tokens`.
    pub max_output_tokens: u64,
    /// Send `ignore_eos: true` (vLLM/SGLang extension), as the chat path does.
    pub ignore_eos: bool,
}

/// The streamed, stored request body of one turn. `temperature` is left to the server's
/// default, as the chat path leaves it.
pub fn responses_body(turn: &ResponsesTurn<'_>) -> Value {
    let mut body = Map::new();
    body.insert("model".into(), json!(turn.model));
    body.insert(
        "input".into(),
        json!([{"role": "user", "content": turn.user}]),
    );
    if let Some(instructions) = turn.instructions {
        body.insert("instructions".into(), json!(instructions));
    }
    if let Some(id) = turn.previous_response_id {
        body.insert("previous_response_id".into(), json!(id));
    }
    body.insert("max_output_tokens".into(), json!(turn.max_output_tokens));
    body.insert("stream".into(), json!(true));
    // Stored, or the next turn's previous_response_id would name nothing.
    body.insert("store".into(), json!(true));
    if turn.ignore_eos {
        body.insert("ignore_eos".into(), json!(true));
    }
    Value::Object(body)
}

/// The non-streaming, unstored body of the probe before a run.
pub fn responses_probe_body(
    model: &str,
    prompt: &str,
    max_output_tokens: u64,
    ignore_eos: bool,
) -> Value {
    let mut body = json!({
        "model": model,
        "input": prompt,
        "max_output_tokens": max_output_tokens,
        "store": false,
    });
    if ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// One completed turn: its response id (the next turn's `previous_response_id`) and its
/// timing, with the usage in chat's terms so per-request records are built alike.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRecord {
    /// The response id.
    pub id: String,
    /// Timing, usage and text.
    pub stream: StreamRecord,
}

/// `usage` of a Responses object.
#[derive(Debug, Deserialize)]
struct ResponsesUsage {
    input_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<InputTokensDetails>,
    output_tokens: u64,
    #[serde(default)]
    total_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct InputTokensDetails {
    #[serde(default)]
    cached_tokens: u64,
}

impl ResponsesUsage {
    /// The same counts under chat's names (`input_tokens` is `prompt_tokens`, ...).
    fn into_chat(self) -> Usage {
        Usage {
            prompt_tokens: self.input_tokens,
            completion_tokens: self.output_tokens,
            total_tokens: self
                .total_tokens
                .unwrap_or(self.input_tokens + self.output_tokens),
            prompt_tokens_details: self.input_tokens_details.map(|d| PromptTokensDetails {
                cached_tokens: d.cached_tokens,
            }),
            ..Default::default()
        }
    }
}

/// What a turn's events have said so far.
#[derive(Debug, Default)]
struct TurnEvents {
    id: Option<String>,
    chunk_offsets: Vec<Duration>,
    text: String,
    final_text: Option<String>,
    usage: Option<Usage>,
    finished: bool,
}

impl TurnEvents {
    /// Takes one event of type `kind` that arrived `at` after sending.
    fn take(&mut self, kind: &str, data: &Value, at: Duration) -> Result<(), RequestError> {
        match kind {
            "response.created" | "response.in_progress" if self.id.is_none() => {
                self.id = response_id(data);
            }
            "response.output_text.delta" => {
                let delta = data.get("delta").and_then(Value::as_str).unwrap_or("");
                if !delta.is_empty() {
                    self.chunk_offsets.push(at);
                    self.text.push_str(delta);
                }
            }
            "response.completed" | "response.incomplete" => {
                let response = data.get("response").unwrap_or(&Value::Null);
                if let Some(id) = response_id(data) {
                    self.id = Some(id);
                }
                if let Some(usage) = response.get("usage").filter(|u| !u.is_null()) {
                    let usage: ResponsesUsage = serde_json::from_value(usage.clone())
                        .map_err(|e| RequestError::NotOpenAi(format!("`usage` of {kind}: {e}")))?;
                    self.usage = Some(usage.into_chat());
                }
                self.final_text = response
                    .pointer("/output/0/content/0/text")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                self.finished = true;
            }
            "error" => {
                // `{"type": "error", "message": ...}`, or the message under `error`.
                let error = data.get("error").unwrap_or(data);
                return Err(RequestError::ErrorEvent(event_error_message(error)));
            }
            "response.failed" => {
                let error = data
                    .pointer("/response/error")
                    .filter(|e| !e.is_null())
                    .cloned()
                    .unwrap_or_else(|| json!("response.failed"));
                return Err(RequestError::ErrorEvent(event_error_message(&error)));
            }
            _ => {}
        }
        Ok(())
    }

    /// The turn's record, once its stream ended at `e2e`.
    fn finish(self, e2e: Duration) -> Result<ResponsesRecord, RequestError> {
        if !self.finished {
            return Err(RequestError::Stream(
                "ended before `response.completed`".into(),
            ));
        }
        let ttft = *self.chunk_offsets.first().ok_or(RequestError::Empty)?;
        let id = self
            .id
            .ok_or_else(|| RequestError::NotOpenAi("the stream named no response id".into()))?;
        Ok(ResponsesRecord {
            id,
            stream: StreamRecord {
                ttft,
                e2e,
                chunk_offsets: self.chunk_offsets,
                usage: self.usage,
                text: self.final_text.unwrap_or(self.text),
            },
        })
    }
}

/// `data.response.id`.
fn response_id(data: &Value) -> Option<String> {
    data.pointer("/response/id")
        .and_then(Value::as_str)
        .map(str::to_string)
}

impl ApiClient {
    /// Sends one streamed turn to `/v1/responses` and reads it to `response.completed`
    /// (or `response.incomplete`).
    pub async fn responses_stream(&self, body: &Value) -> Result<ResponsesRecord, RequestError> {
        self.bounded(self.responses_stream_inner(body)).await
    }

    async fn responses_stream_inner(&self, body: &Value) -> Result<ResponsesRecord, RequestError> {
        let (resp, start) = self.open_stream(RESPONSES_PATH, body).await?;
        let mut events = std::pin::pin!(resp.bytes_stream().eventsource());
        let mut turn = TurnEvents::default();
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| match e {
                EventStreamError::Transport(e) => RequestError::Stream(error_chain(&e)),
                other => RequestError::Stream(other.to_string()),
            })?;
            if event.data.is_empty() {
                continue;
            }
            let at = start.elapsed();
            let data: Value = serde_json::from_str(&event.data).map_err(|_| {
                RequestError::NotOpenAi(format!("event is not JSON: {}", snippet(&event.data)))
            })?;
            // `data.type` repeats the `event:` line; it is the one every server sends.
            let kind = data
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or(&event.event)
                .to_string();
            turn.take(&kind, &data, at)?;
            if turn.finished {
                break;
            }
        }
        turn.finish(start.elapsed())
    }

    /// Sends one small non-streaming `/v1/responses` request and checks that the answer
    /// is a Responses object.
    pub async fn responses_once(&self, body: &Value) -> Result<(), RequestError> {
        let answer = self.bounded(self.post_json(RESPONSES_PATH, body)).await?;
        if answer.get("status").and_then(Value::as_str) == Some("failed") {
            let error = answer.get("error").cloned().unwrap_or(Value::Null);
            return Err(RequestError::ErrorEvent(event_error_message(&error)));
        }
        match answer.get("id").and_then(Value::as_str) {
            Some(_) => Ok(()),
            None => Err(RequestError::NotOpenAi(format!(
                "expected a Responses object, got {}",
                snippet(&answer.to_string())
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn completed(kind: &str) -> Value {
        json!({"type": kind, "response": {
            "id": "resp_9", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": " a b"}]}],
            "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 24},
                      "output_tokens": 2, "total_tokens": 32}}})
    }

    #[test]
    fn first_turn_body_has_no_previous_id_and_later_ones_do() {
        let mut turn = ResponsesTurn {
            model: "m",
            user: "hello",
            instructions: Some("be brief"),
            previous_response_id: None,
            max_output_tokens: 7,
            ignore_eos: true,
        };
        let body = responses_body(&turn);
        assert_eq!(body["input"], json!([{"role": "user", "content": "hello"}]));
        assert_eq!(body["instructions"], "be brief");
        assert_eq!(
            (&body["max_output_tokens"], &body["stream"], &body["store"]),
            (&json!(7), &json!(true), &json!(true))
        );
        assert_eq!(body["ignore_eos"], true);
        assert!(body.get("previous_response_id").is_none());
        turn.previous_response_id = Some("resp_1");
        turn.instructions = None;
        turn.ignore_eos = false;
        let body = responses_body(&turn);
        assert_eq!(body["previous_response_id"], "resp_1");
        assert!(body.get("instructions").is_none() && body.get("ignore_eos").is_none());
    }

    #[test]
    fn events_give_id_ttft_itl_and_usage() {
        for end in ["response.completed", "response.incomplete"] {
            let mut turn = TurnEvents::default();
            let created = json!({"type": "response.created", "response": {"id": "resp_9"}});
            turn.take("response.created", &created, ms(1)).unwrap();
            let empty = json!({"type": "response.output_text.delta", "delta": ""});
            turn.take("response.output_text.delta", &empty, ms(2))
                .unwrap();
            for (at, delta) in [(10, " a"), (15, " b")] {
                let d = json!({"type": "response.output_text.delta", "delta": delta});
                turn.take("response.output_text.delta", &d, ms(at)).unwrap();
            }
            turn.take(end, &completed(end), ms(16)).unwrap();
            let record = turn.finish(ms(17)).unwrap();
            assert_eq!(record.id, "resp_9");
            let r = record.stream;
            assert_eq!((r.ttft, r.inter_token_latencies()), (ms(10), vec![ms(5)]));
            let usage = r.usage.clone().unwrap();
            assert_eq!((usage.prompt_tokens, usage.completion_tokens), (30, 2));
            assert_eq!(usage.prompt_tokens_details.unwrap().cached_tokens, 24);
            assert_eq!(r.output_tokens(), 2);
            assert_eq!(r.text, " a b");
        }
    }

    #[test]
    fn error_events_and_unfinished_streams_fail() {
        let mut turn = TurnEvents::default();
        let error = json!({"type": "error", "code": "server_error", "message": "boom"});
        assert_eq!(
            turn.take("error", &error, ms(1)),
            Err(RequestError::ErrorEvent("boom".into()))
        );
        let failed = json!({"type": "response.failed",
            "response": {"id": "r", "status": "failed", "error": {"message": "oom"}}});
        assert_eq!(
            turn.take("response.failed", &failed, ms(1)),
            Err(RequestError::ErrorEvent("oom".into()))
        );
        let mut turn = TurnEvents::default();
        let d = json!({"type": "response.output_text.delta", "delta": " a"});
        turn.take("response.output_text.delta", &d, ms(1)).unwrap();
        assert!(matches!(turn.finish(ms(2)), Err(RequestError::Stream(_))));
        let mut turn = TurnEvents::default();
        let end = completed("response.completed");
        turn.take("response.completed", &end, ms(1)).unwrap();
        assert_eq!(turn.finish(ms(2)), Err(RequestError::Empty));
    }
}
