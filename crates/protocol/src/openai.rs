//! OpenAI chat/completions requests, responses, stream chunks and model lists.
//!
//! Numeric limits are kept as signed integers so that the engine, not the JSON decoder,
//! says what is wrong with `max_tokens: -1`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::kv::KvTransferParams;

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

impl StopSequences {
    /// The stop strings as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s.clone()],
            Self::Many(v) => v.clone(),
        }
    }
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A chat message's `content`: plain text or a list of typed parts (text, image_url, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<Value>),
}

impl MessageContent {
    /// The text of the message: the string, or the `text` parts joined.
    pub fn text(&self) -> String {
        match self {
            Self::Text(s) => s.clone(),
            Self::Parts(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

/// One message of a chat conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Sampling and generation fields common to chat and completion requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSequences>,
    /// vLLM extension: keep generating past EOS (benchmarks use it for fixed output length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Subtracted from the logit of each token already generated (-2..=2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Subtracted once per earlier occurrence in the output (-2..=2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// vLLM extension: penalises tokens of the prompt and output multiplicatively (> 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    /// vLLM extension: smallest probability relative to the most likely token (0..=1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// Token id (as a string) to a bias added to its logit, clamped to -100..=100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
}

/// Fields that steer streaming and KV handoff, common to chat and completion requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransportParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// SGLang's bootstrap fields: one value, or one per choice when `n` > 1 (as SGLang's
    /// router sends them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_host: Option<OneOrMany<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<OneOrMany<Option<u16>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_room: Option<OneOrMany<u64>>,
}

/// Makes a request the prefill leg of a P/D handoff, as vLLM's disaggregation proxies
/// send it: one token, not streamed (so no `stream_options`), no `min_tokens` or
/// `max_completion_tokens`, and `params` asking the prefill worker to keep the prompt's
/// KV for the decode side.
pub fn shape_prefill_leg(
    transport: &mut TransportParams,
    generation: &mut GenerationParams,
    params: KvTransferParams,
) {
    transport.stream = Some(false);
    transport.stream_options = None;
    transport.kv_transfer_params = Some(params);
    generation.max_tokens = Some(1);
    generation.max_completion_tokens = None;
    generation.min_tokens = None;
    // One copy of the prompt: the decode worker serves every choice from it (vLLM would
    // prefill `n` copies, hand decode one and leave the rest pinned until their lease ends).
    generation.n = None;
}

/// A field given once for all items, or as a list with one value per item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Chat `logprobs` is a flag; `top_logprobs` says how many alternatives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub generation: GenerationParams,
    #[serde(flatten)]
    pub transport: TransportParams,
    /// Fields this type does not model, passed through unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// Top-level numbers kept as the client wrote them (name, JSON text), for a proxy
    /// that must forward them byte for byte; not part of (de)serialisation.
    #[serde(skip)]
    pub verbatim_numbers: Vec<(String, String)>,
}

/// A completion `prompt`: text, several texts, token ids, or several token-id lists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Completions `logprobs` is the number of alternatives per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub generation: GenerationParams,
    #[serde(flatten)]
    pub transport: TransportParams,
    /// Fields this type does not model, passed through unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// Top-level numbers kept as the client wrote them (name, JSON text), for a proxy
    /// that must forward them byte for byte; not part of (de)serialisation.
    #[serde(skip)]
    pub verbatim_numbers: Vec<(String, String)>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// pdserve's own counts (absent when there is nothing to report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pdserve: Option<PdserveUsage>,
}

/// `usage.pdserve`: where the prompt's KV came from, which OpenAI's usage has no field
/// for. `prompt_tokens_details.cached_tokens` (prompt tokens computed by no one for this
/// request) is `prefix_cache_tokens + earlier_turn_tokens`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PdserveUsage {
    /// Cached prompt tokens found in a prefix cache: the answering worker's, or the
    /// prefill worker's for KV it handed over.
    #[serde(default)]
    pub prefix_cache_tokens: u64,
    /// Cached prompt tokens an earlier turn of the conversation computed, handed back by
    /// its decode worker to this turn's prefill.
    #[serde(default)]
    pub earlier_turn_tokens: u64,
    /// Prompt tokens whose KV this worker loaded from a peer (P/D) instead of computing
    /// them; those the peer computed for this request are not cached.
    #[serde(default)]
    pub kv_imported_tokens: u64,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u64,
}

impl Usage {
    /// Usage with `total_tokens` filled in and the cached-token count reported.
    pub fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
            pdserve: None,
        }
    }

    /// The same usage with its `usage.pdserve` breakdown: `earlier_turn_tokens` of the
    /// cached tokens came from an earlier turn (the rest from a prefix cache), and
    /// `kv_imported_tokens` were loaded from a peer. Absent when all are zero.
    pub fn with_sources(mut self, earlier_turn_tokens: u64, kv_imported_tokens: u64) -> Self {
        let cached = self
            .prompt_tokens_details
            .as_ref()
            .map_or(0, |d| d.cached_tokens);
        let breakdown = PdserveUsage {
            prefix_cache_tokens: cached.saturating_sub(earlier_turn_tokens),
            earlier_turn_tokens,
            kv_imported_tokens,
        };
        self.pdserve = (breakdown != PdserveUsage::default()).then_some(breakdown);
        self
    }

    /// Adds `other`'s counts (the usage of a batch's answers summed, as vLLM reports one
    /// request of several prompts).
    pub fn add(&mut self, other: &Usage) {
        let cached = |u: &Usage| {
            u.prompt_tokens_details
                .as_ref()
                .map_or(0, |d| d.cached_tokens)
        };
        let sources = |u: &Usage| {
            u.pdserve
                .as_ref()
                .map_or((0, 0), |p| (p.earlier_turn_tokens, p.kv_imported_tokens))
        };
        let (earlier, imported) = sources(self);
        let (other_earlier, other_imported) = sources(other);
        *self = Usage::new(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            cached(self) + cached(other),
        )
        .with_sources(earlier + other_earlier, imported + other_imported);
    }
}

/// One alternative token and its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<Vec<u8>>,
}

/// A sampled token's log-probability with its alternatives (chat format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<Vec<u8>>,
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `choices[].logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// Completions `choices[].logprobs` (the legacy columnar format).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<u32>,
}

/// One choice of a non-streaming chat response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Non-streaming `chat.completion` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The incremental message of a streamed chat choice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One choice of a `chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// Streaming `chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One choice of a `text_completion` (streamed or not).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `text_completion` response, and each chunk of a streamed one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    #[serde(default = "model_object")]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub owned_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn model_object() -> String {
    "model".to_string()
}

/// `GET /v1/models` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// Seconds since the Unix epoch, for `created` fields.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_request_round_trips_vendor_fields() {
        let body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi", "name": "bob"}],
            "max_tokens": 5,
            "stream": true,
            "stream_options": {"include_usage": true},
            "kv_transfer_params": {"do_remote_decode": true},
            "conversation_id": "c1",
            "chat_template_kwargs": {"enable_thinking": false}
        });
        let req: ChatCompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(req.generation.max_tokens, Some(5));
        assert_eq!(req.transport.stream, Some(true));
        assert_eq!(req.extra["conversation_id"], "c1");
        assert_eq!(req.messages[0].extra["name"], "bob");
        let back = serde_json::to_value(&req).unwrap();
        assert_eq!(back["chat_template_kwargs"], body["chat_template_kwargs"]);
        assert_eq!(back["kv_transfer_params"]["do_remote_decode"], true);
        assert!(back.get("top_p").is_none(), "absent fields stay absent");
    }

    #[test]
    fn wrong_types_are_rejected_with_a_message() {
        let err = serde_json::from_value::<ChatCompletionRequest>(json!({
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": "ten"
        }))
        .unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
        assert!(serde_json::from_value::<ChatCompletionRequest>(json!({"model": "m"})).is_err());
    }

    #[test]
    fn completion_prompt_shapes() {
        for (v, want) in [
            (json!("a"), Prompt::Text("a".into())),
            (
                json!(["a", "b"]),
                Prompt::Texts(vec!["a".into(), "b".into()]),
            ),
            (json!([1, 2]), Prompt::Tokens(vec![1, 2])),
            (
                json!([[1], [2]]),
                Prompt::TokenBatches(vec![vec![1], vec![2]]),
            ),
        ] {
            let req: CompletionRequest =
                serde_json::from_value(json!({"model": "m", "prompt": v})).unwrap();
            assert_eq!(req.prompt, want);
        }
    }
}
