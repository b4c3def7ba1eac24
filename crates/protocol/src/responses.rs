//! OpenAI's Responses API (`POST /v1/responses`): the request as workers and the gateway
//! read it. Sampling and transport fields are the ones chat and completions share (so
//! `temperature`, `top_p`, `seed`, `stream` and vLLM's `kv_transfer_params` are checked
//! the same way); `max_output_tokens` is this API's length limit.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::openai::{GenerationParams, TransportParams};

/// `POST /v1/responses` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A string (one user message) or a list of message items.
    pub input: ResponseInput,
    /// A system message put before the conversation (not carried to the next turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<i64>,
    /// The stored response whose conversation this one continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// Keep the response for `GET /v1/responses/{id}` and later turns (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    #[serde(flatten)]
    pub generation: GenerationParams,
    #[serde(flatten)]
    pub transport: TransportParams,
    /// Fields this type does not model (`tools`, `text`, `reasoning`, `metadata`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `input`: a string, or message items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ResponseInput {
    Text(String),
    Items(Vec<InputItem>),
}

/// One input item: a message (`type` `message`, or no `type` with a `role`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<ItemContent>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A message item's content: a string or content parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ItemContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part (`input_text`, `output_text`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}
