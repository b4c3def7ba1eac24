//! A client's `/v1/responses` body as the gateway forwards it: checked against the
//! protocol type (so a mistyped field is a 400 here, as on a worker), stripped of the
//! fields only the gateway writes, its input as message items, and the bodies each leg
//! gets: the conversation written out in full for a worker that does not store it, the
//! one-token prefill leg, and a chat request that routes and counts it as the worker
//! will render it.

use bytes::Bytes;
use pdserve_protocol::responses::{ResponseInput, ResponsesRequest};
use pdserve_protocol::{ApiError, KvTransferParams};
use serde_json::{json, Map, Value};

use crate::endpoint::Endpoint;
use crate::ingress::request::{json_error, ClientRequest};

/// Fields only the gateway writes: KV handles, SGLang's bootstrap address, the encoder
/// cache's handles (each would make a worker connect where the client says).
const GATEWAY_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    pdserve_protocol::kv::EC_TRANSFER_PARAMS,
];

/// A validated `/v1/responses` body.
#[derive(Debug, Clone)]
pub struct ResponsesBody {
    /// The body as the client wrote it, less [`GATEWAY_FIELDS`].
    body: Map<String, Value>,
    /// This turn's input as message items.
    pub input: Vec<Value>,
    /// The stored response this one continues.
    pub previous_response_id: Option<String>,
    /// The conversation (`/v1/conversations`) this turn continues and is appended to.
    pub conversation: Option<String>,
    /// Whether the client asked for the event stream.
    pub stream: bool,
    /// Whether the answer is stored (`store`, default true).
    pub store: bool,
}

impl ResponsesBody {
    /// Parses and checks a client body.
    // ApiError is the protocol crate's error value, built once per rejected request.
    #[allow(clippy::result_large_err)]
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(bytes).map_err(json_error)?;
        let Value::Object(mut body) = value else {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        };
        for field in GATEWAY_FIELDS {
            body.remove(*field);
        }
        // Only the gateway knows conversations: workers are sent their items instead.
        let conversation = conversation_id(body.remove("conversation"))?;
        let typed: ResponsesRequest =
            serde_json::from_value(Value::Object(body.clone())).map_err(json_error)?;
        let input = match typed.input {
            ResponseInput::Text(text) => vec![json!({"role": "user", "content": text})],
            ResponseInput::Items(_) => match body.get("input") {
                Some(Value::Array(items)) => items.clone(),
                _ => Vec::new(),
            },
        };
        if conversation.is_some() && typed.previous_response_id.is_some() {
            return Err(ApiError::new(
                http::StatusCode::BAD_REQUEST,
                "mutually_exclusive_parameters",
                "Mutually exclusive parameters: Ensure you are only providing one of: \
                 'previous_response_id' or 'conversation'.",
            ));
        }
        Ok(Self {
            input,
            previous_response_id: typed.previous_response_id,
            conversation,
            stream: typed.transport.stream.unwrap_or(false),
            store: typed.store.unwrap_or(true),
            body,
        })
    }

    /// The body as the client sent it (with `previous_response_id`: for the worker that
    /// stores that response).
    pub fn original(&self) -> Map<String, Value> {
        self.body.clone()
    }

    /// [`Self::expanded`] when `write_out`, else [`Self::original`].
    pub fn body_for(&self, write_out: bool, before: &[Value]) -> Map<String, Value> {
        if write_out {
            self.expanded(before)
        } else {
            self.original()
        }
    }

    /// The body with the conversation so far written out before this turn's input and
    /// without `previous_response_id`: for a worker that does not store the conversation.
    pub fn expanded(&self, before: &[Value]) -> Map<String, Value> {
        let mut body = self.body.clone();
        body.remove("previous_response_id");
        let mut items = before.to_vec();
        items.extend(self.input.iter().cloned());
        body.insert("input".into(), Value::Array(items));
        body
    }

    /// The chat request a worker renders this turn as (`instructions` as the system
    /// message, then the conversation): what policies route on, the tokenizer counts and
    /// admission reads the priority of.
    // ApiError is the protocol crate's error value, built once per rejected request.
    #[allow(clippy::result_large_err)]
    pub fn as_chat(&self, before: &[Value]) -> Result<ClientRequest, ApiError> {
        let mut messages = Vec::with_capacity(before.len() + self.input.len() + 1);
        if let Some(instructions) = self.body.get("instructions").and_then(Value::as_str) {
            messages.push(json!({"role": "system", "content": instructions}));
        }
        for item in before.iter().chain(&self.input) {
            if let Some(message) = chat_message(item) {
                messages.push(message);
            }
        }
        let mut chat = Map::new();
        chat.insert("messages".into(), Value::Array(messages));
        for (from, to) in [
            ("model", "model"),
            ("max_output_tokens", "max_tokens"),
            ("priority", "priority"),
        ] {
            if let Some(value) = self.body.get(from).filter(|v| !v.is_null()) {
                chat.insert(to.into(), value.clone());
            }
        }
        let bytes = serde_json::to_vec(&Value::Object(chat)).unwrap_or_default();
        ClientRequest::parse(Endpoint::Chat, &bytes).map(|(request, _)| request)
    }
}

/// The `conversation` parameter's id: a string, or an object with its `id`.
#[allow(clippy::result_large_err)]
fn conversation_id(value: Option<Value>) -> Result<Option<String>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) => Ok(Some(id)),
        Some(Value::Object(object)) => match object.get("id") {
            Some(Value::String(id)) => Ok(Some(id.clone())),
            _ => Err(ApiError::bad_request("'conversation.id' must be a string.")
                .with_param("conversation.id")),
        },
        Some(_) => Err(ApiError::bad_request(
            "'conversation' must be a conversation id or an object with its 'id'.",
        )
        .with_param("conversation")),
    }
}

/// A message item as a chat message with text content (`developer` is `system`, as the
/// workers render it); other items are not part of the routed text.
fn chat_message(item: &Value) -> Option<Value> {
    if item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message")
        != "message"
    {
        return None;
    }
    let role = match item.get("role")?.as_str()? {
        "developer" => "system",
        role => role,
    };
    let content = match item.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    Some(json!({"role": role, "content": content}))
}

/// vLLM's prefill leg of `body`: one output token, not streamed, not stored, asking P to
/// keep its blocks for D (`params`).
pub fn prefill_body(body: &Map<String, Value>, params: KvTransferParams) -> Bytes {
    let mut body = body.clone();
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    body.insert("store".into(), Value::Bool(false));
    body.insert("max_output_tokens".into(), json!(1));
    body.insert("kv_transfer_params".into(), json!(params));
    encode(&body)
}

/// `body` as bytes.
pub fn encode(body: &Map<String, Value>) -> Bytes {
    // A map of JSON values always serializes.
    Bytes::from(serde_json::to_vec(body).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> ResponsesBody {
        ResponsesBody::parse(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn text_input_is_one_user_message_and_gateway_fields_are_dropped() {
        let body = parse(json!({
            "input": "hi", "stream": true, "store": false,
            "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.1"},
            "bootstrap_host": "127.0.0.1", "bootstrap_room": 3
        }));
        assert_eq!(body.input, vec![json!({"role": "user", "content": "hi"})]);
        assert!(body.stream && !body.store);
        let original = body.original();
        for field in GATEWAY_FIELDS {
            assert!(!original.contains_key(*field), "{field}");
        }
    }

    #[test]
    fn expanded_writes_the_conversation_out_and_drops_the_previous_id() {
        let body = parse(json!({
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "q2"}]}],
            "previous_response_id": "resp_1",
            "instructions": "be brief",
            "max_output_tokens": 9,
            "priority": 3,
        }));
        assert_eq!(body.previous_response_id.as_deref(), Some("resp_1"));
        let before = [
            json!({"role": "user", "content": "q1"}),
            json!({"role": "assistant", "content": "a1"}),
        ];
        let expanded = body.expanded(&before);
        assert!(!expanded.contains_key("previous_response_id"));
        assert_eq!(expanded["input"].as_array().unwrap().len(), 3);
        assert_eq!(expanded["input"][0]["content"], "q1");
        let ClientRequest::Chat(chat) = body.as_chat(&before).unwrap() else {
            panic!("a chat request")
        };
        let roles: Vec<_> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(chat.generation.max_tokens, Some(9));
        assert_eq!(
            chat.messages[3].content.as_ref().unwrap().text(),
            "q2",
            "content parts are joined as the worker joins them"
        );
    }

    #[test]
    fn the_prefill_leg_asks_for_one_unstored_token() {
        let body = parse(json!({"input": "hi", "stream": true, "max_output_tokens": 50}));
        let leg: Value = serde_json::from_slice(&prefill_body(
            &body.expanded(&[]),
            KvTransferParams::prefill_request(),
        ))
        .unwrap();
        assert_eq!(leg["stream"], false);
        assert_eq!(leg["store"], false);
        assert_eq!(leg["max_output_tokens"], 1);
        assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    }

    #[test]
    fn mistyped_bodies_are_400s() {
        for bad in [
            &b"{"[..],
            b"[1]",
            br#"{"input": 5}"#,
            br#"{"input": "x", "stream": "yes"}"#,
            br#"{"input": "x", "previous_response_id": 7}"#,
            br#"{"input": "x", "conversation": 7}"#,
            br#"{"input": "x", "conversation": {"id": 7}}"#,
        ] {
            let e = ResponsesBody::parse(bad).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn a_conversation_is_an_id_or_an_object_and_excludes_a_previous_response() {
        let by_id = parse(json!({"input": "x", "conversation": "conv_1"}));
        assert_eq!(by_id.conversation.as_deref(), Some("conv_1"));
        assert!(!by_id.original().contains_key("conversation"));
        let by_object = parse(json!({"input": "x", "conversation": {"id": "conv_2"}}));
        assert_eq!(by_object.conversation.as_deref(), Some("conv_2"));
        let both = ResponsesBody::parse(
            br#"{"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}"#,
        )
        .unwrap_err();
        assert_eq!(both.status, http::StatusCode::BAD_REQUEST);
        assert_eq!(
            both.body.error.code,
            Some(json!("mutually_exclusive_parameters"))
        );
    }
}
