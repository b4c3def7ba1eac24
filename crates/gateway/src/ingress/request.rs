//! Client bodies parsed into `pdserve_protocol` request types, with OpenAI-shaped 400s.

use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use bytes::Bytes;
use pdserve_protocol::{
    ApiError, ChatCompletionRequest, CompletionRequest, GenerationParams, TransportParams,
};
use std::collections::HashMap;

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::endpoint::Endpoint;

/// The gateway's own top-level field naming a conversation; never forwarded.
pub use pdserve_protocol::session::CONVERSATION_ID;

/// Top-level numbers the gateway reads or rewrites (the prefill leg's length fields,
/// the bootstrap handoff's room and port); every other number is passed through untyped.
pub const OWNED_NUMBERS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "bootstrap_port",
    "bootstrap_room",
];

/// A validated chat or completion request (unknown fields kept for forwarding). Top-level
/// numbers other than [`OWNED_NUMBERS`] (`temperature`, `top_p`, `seed`, ...) are held in
/// `extra` as parsed, not in the protocol types' fields.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientRequest {
    /// A `/v1/chat/completions` body.
    Chat(ChatCompletionRequest),
    /// A `/v1/completions` body.
    Completion(CompletionRequest),
}

impl ClientRequest {
    /// Parses a client body for `endpoint`; returns the request with `conversation_id`
    /// taken out of it, and the conversation id if one was given.
    // ApiError is the protocol crate's error value, built once per rejected request;
    // boxing it would only add an allocation on the error path.
    #[allow(clippy::result_large_err)]
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<(Self, Option<String>), ApiError> {
        let mut fields: Map<String, Value> = serde_json::from_slice(body).map_err(json_error)?;
        // Numbers the gateway does not own skip the protocol types (whose f32 fields would
        // turn `1e39` into infinity and then `null`, i.e. the worker's default) and are
        // forwarded as the client wrote them, byte for byte: the worker judges them, as it
        // would without the gateway.
        let passed: Vec<String> = fields
            .iter()
            .filter(|(key, value)| {
                value.is_number()
                    && key.as_str() != CONVERSATION_ID
                    && !OWNED_NUMBERS.contains(&key.as_str())
            })
            .map(|(key, _)| key.clone())
            .collect();
        let verbatim = if passed.is_empty() {
            Vec::new()
        } else {
            // A second, lexing-only pass gives each top-level value's source text.
            let raw: HashMap<String, &RawValue> =
                serde_json::from_slice(body).map_err(json_error)?;
            passed
                .into_iter()
                .filter_map(|key| {
                    fields.remove(&key);
                    let text = raw.get(&key)?.get().to_string();
                    Some((key, text))
                })
                .collect()
        };
        let mut request = match endpoint {
            Endpoint::Chat => serde_json::from_value(Value::Object(fields)).map(Self::Chat),
            Endpoint::Completions => {
                serde_json::from_value(Value::Object(fields)).map(Self::Completion)
            }
            // Its own body type (crate::responses); never parsed as one of these.
            Endpoint::Responses => {
                return Err(ApiError::bad_request(
                    "a Responses body is not a chat or completion request",
                ))
            }
        }
        .map_err(json_error)?;
        *request.verbatim_numbers_mut() = verbatim;
        // Only the gateway writes KV handles: a client's would make a worker open a
        // connection to any address the client names. The same holds for the encoder
        // cache's handles (peer hosts and ports of published embeddings).
        request.transport_mut().kv_transfer_params = None;
        request
            .extra_mut()
            .remove(pdserve_protocol::kv::EC_TRANSFER_PARAMS);
        let conversation_id = match request.extra_mut().remove(CONVERSATION_ID) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => {
                return Err(ApiError::bad_request("`conversation_id` must be a string")
                    .with_param(CONVERSATION_ID))
            }
        };
        Ok((request, conversation_id))
    }

    /// A top-level number the client gave, as it wrote it: one held verbatim (see
    /// [`OWNED_NUMBERS`]) or none.
    pub fn verbatim_number(&self, name: &str) -> Option<&str> {
        let verbatim = match self {
            Self::Chat(r) => &r.verbatim_numbers,
            Self::Completion(r) => &r.verbatim_numbers,
        };
        verbatim
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, text)| text.as_str())
    }

    /// Sampling and length fields.
    pub fn generation_mut(&mut self) -> &mut GenerationParams {
        match self {
            Self::Chat(r) => &mut r.generation,
            Self::Completion(r) => &mut r.generation,
        }
    }

    /// Streaming and KV-handoff fields.
    pub fn transport(&self) -> &TransportParams {
        match self {
            Self::Chat(r) => &r.transport,
            Self::Completion(r) => &r.transport,
        }
    }

    /// Streaming and KV-handoff fields, mutable.
    pub fn transport_mut(&mut self) -> &mut TransportParams {
        match self {
            Self::Chat(r) => &mut r.transport,
            Self::Completion(r) => &mut r.transport,
        }
    }

    /// Streaming and KV-handoff fields and sampling fields, both mutable at once.
    pub fn params_mut(&mut self) -> (&mut TransportParams, &mut GenerationParams) {
        match self {
            Self::Chat(r) => (&mut r.transport, &mut r.generation),
            Self::Completion(r) => (&mut r.transport, &mut r.generation),
        }
    }

    /// Fields the protocol types do not model.
    pub fn extra_mut(&mut self) -> &mut Map<String, Value> {
        match self {
            Self::Chat(r) => &mut r.extra,
            Self::Completion(r) => &mut r.extra,
        }
    }

    /// Top-level numbers forwarded as the client wrote them (name, JSON text).
    pub fn verbatim_numbers_mut(&mut self) -> &mut Vec<(String, String)> {
        match self {
            Self::Chat(r) => &mut r.verbatim_numbers,
            Self::Completion(r) => &mut r.verbatim_numbers,
        }
    }

    /// Whether the client asked for a server-sent event stream.
    pub fn is_stream(&self) -> bool {
        self.transport().stream.unwrap_or(false)
    }

    /// The request as a JSON body for a worker.
    pub fn to_body(&self) -> Bytes {
        let (bytes, verbatim) = match self {
            Self::Chat(r) => (serde_json::to_vec(r), &r.verbatim_numbers),
            Self::Completion(r) => (serde_json::to_vec(r), &r.verbatim_numbers),
        };
        // These types serialize infallibly (string keys, no custom serializers).
        let mut bytes = bytes.unwrap_or_default();
        append_verbatim(&mut bytes, verbatim);
        Bytes::from(bytes)
    }
}

/// Splices `verbatim` fields (name, the client's JSON text) into the serialized object
/// `bytes`, before its closing brace.
pub fn append_verbatim(bytes: &mut Vec<u8>, verbatim: &[(String, String)]) {
    if verbatim.is_empty() || bytes.last() != Some(&b'}') {
        return;
    }
    bytes.pop();
    for (key, text) in verbatim {
        if bytes.len() > 1 {
            bytes.push(b',');
        }
        // A string key always serializes.
        let _ = serde_json::to_writer(&mut *bytes, key);
        bytes.push(b':');
        bytes.extend_from_slice(text.as_bytes());
    }
    bytes.push(b'}');
}

/// A 400 that says whether the JSON was malformed or had a wrong field.
pub(crate) fn json_error(e: serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::bad_request(format!("The request body is not valid JSON: {e}"))
        }
        Category::Data => ApiError::bad_request(format!("Invalid request body: {e}")),
    }
}

/// Maps axum's body-reading rejection to our errors: over the limit → 413, else 400 (a
/// body past `--body-read-timeout-secs` becomes 408 in `pdserve-http-server`).
pub fn body_rejection(rejection: BytesRejection, limit: usize) -> ApiError {
    match rejection {
        BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) => {
            ApiError::payload_too_large(limit)
        }
        other => ApiError::bad_request(format!("Could not read the request body: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn takes_conversation_id_out() {
        let (req, conv) = ClientRequest::parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"conversation_id":"c1","x":1}"#,
        )
        .unwrap();
        assert_eq!(conv.as_deref(), Some("c1"));
        let body: Value = serde_json::from_slice(&req.to_body()).unwrap();
        assert!(body.get(CONVERSATION_ID).is_none());
        assert_eq!(body["x"], 1);
    }

    #[test]
    fn numbers_it_does_not_own_pass_unchanged() {
        let (mut req, _) = ClientRequest::parse(
            Endpoint::Completions,
            br#"{"prompt":"a","temperature":1e39,"top_p":1E+39,"seed":123456789012345678901234567890,"presence_penalty":0.300000000000000000000000001,"top_k":5,"min_p":5e-2,"max_tokens":7}"#,
        )
        .unwrap();
        let body = String::from_utf8(req.to_body().to_vec()).unwrap();
        for kept in [
            // Byte for byte, as the client wrote them (no f64 or integer round trip).
            r#""temperature":1e39"#,
            r#""top_p":1E+39"#,
            r#""seed":123456789012345678901234567890"#,
            r#""presence_penalty":0.300000000000000000000000001"#,
            r#""top_k":5"#,
            r#""min_p":5e-2"#,
        ] {
            assert!(body.contains(kept), "{kept} missing from {body}");
        }
        // The length fields stay typed: the prefill leg rewrites them.
        assert_eq!(req.generation_mut().max_tokens, Some(7));
        req.generation_mut().max_tokens = Some(1);
        let body = String::from_utf8(req.to_body().to_vec()).unwrap();
        assert_eq!(body.matches("max_tokens").count(), 1, "{body}");
        assert!(body.contains(r#""max_tokens":1"#), "{body}");
    }

    #[test]
    fn drops_client_kv_transfer_params() {
        for (endpoint, body) in [
            (
                Endpoint::Chat,
                &br#"{"messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":22}}"#[..],
            ),
            (
                Endpoint::Completions,
                br#"{"prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}"#,
            ),
            (
                Endpoint::Chat,
                br#"{"messages":[{"role":"user","content":"hi"}],"ec_transfer_params":{"h":{"peer_host":"127.0.0.1","peer_port":22}}}"#,
            ),
        ] {
            let (req, _) = ClientRequest::parse(endpoint, body).unwrap();
            let forwarded: Value = serde_json::from_slice(&req.to_body()).unwrap();
            assert!(forwarded.get("kv_transfer_params").is_none(), "{forwarded}");
            assert!(forwarded.get("ec_transfer_params").is_none(), "{forwarded}");
        }
    }

    #[test]
    fn rejects_malformed_and_mistyped_bodies() {
        for (endpoint, body) in [
            (Endpoint::Chat, &b"{not json"[..]),
            (Endpoint::Chat, br#"{"messages":"hi"}"#),
            (Endpoint::Chat, br#"[1,2]"#),
            (Endpoint::Completions, br#"{"model":"m"}"#),
            (Endpoint::Completions, br#"{"prompt":"a","stream":"yes"}"#),
            (
                Endpoint::Completions,
                br#"{"prompt":"a","conversation_id":5}"#,
            ),
        ] {
            let err = ClientRequest::parse(endpoint, body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert_eq!(err.body.error.kind, "invalid_request_error");
        }
    }
}
