//! One streaming request against an OpenAI-compatible server, timed chunk by chunk.
//!
//! A *content chunk* is a stream event whose first choice carries non-empty text
//! (`text`, `delta.content` or `delta.reasoning_content`). TTFT is the arrival of the
//! first content chunk (a leading role-only chat chunk does not count), ITL the gaps
//! between content chunks, and the output token count is `usage.completion_tokens`
//! when the server reports it (we ask with `stream_options.include_usage`), else the
//! number of content chunks.

use std::time::{Duration, Instant};

use futures::StreamExt;
use pdserve_protocol::sse::{self, SseMessage};
use pdserve_protocol::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, ErrorBody, GenerationParams,
    MessageContent, ModelList, Prompt, StreamOptions, TransportParams, Usage,
};
use serde_json::{Map, Value};

/// Errors with their causes, shared with the rest of the bench.
pub(crate) use pdserve_protocol::error_chain;

use crate::args::{Endpoint, ServerArgs};
use crate::BenchError;

/// Why one request failed; its `Display` is the failure reason in reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// No TCP connection (refused, unresolvable, or the connect timeout passed).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The request did not finish within `--request-timeout-s`.
    #[error("timed out after {0:.1} s")]
    Timeout(f64),
    /// The server answered an HTTP error.
    #[error("HTTP {status}: {message}")]
    Status {
        /// HTTP status code.
        status: u16,
        /// The OpenAI error message, or the start of the body.
        message: String,
    },
    /// The answer is not an OpenAI event stream (HTML, plain JSON, ...).
    #[error("not an OpenAI-compatible stream: {0}")]
    NotOpenAi(String),
    /// The stream broke off or held something that is not a chunk.
    #[error("broken stream: {0}")]
    Stream(String),
    /// The server sent an error event inside the stream.
    #[error("error event: {0}")]
    ErrorEvent(String),
    /// The stream ended without any content.
    #[error("the stream carried no text")]
    Empty,
}

/// The timing and accounting of one successful streamed request.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamRecord {
    /// From sending the request to the first content chunk.
    pub ttft: Duration,
    /// From sending the request to `data: [DONE]`.
    pub e2e: Duration,
    /// Arrival of every content chunk, from sending the request.
    pub chunk_offsets: Vec<Duration>,
    /// The last `usage` the server reported, if any.
    pub usage: Option<Usage>,
    /// The generated text.
    pub text: String,
}

impl StreamRecord {
    /// Output tokens: `usage.completion_tokens` if reported, else the content chunks.
    pub fn output_tokens(&self) -> u64 {
        match &self.usage {
            Some(u) if u.completion_tokens > 0 => u.completion_tokens,
            _ => self.chunk_offsets.len() as u64,
        }
    }

    /// Gaps between consecutive content chunks.
    pub fn inter_token_latencies(&self) -> Vec<Duration> {
        self.chunk_offsets
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .collect()
    }

    /// Time per output token after the first; `None` for a single-token answer.
    pub fn tpot(&self) -> Option<Duration> {
        let n = self.output_tokens();
        (n > 1).then(|| self.e2e.saturating_sub(self.ttft) / (n - 1) as u32)
    }
}

/// What to send: a prompt for `/v1/completions` or messages for `/v1/chat/completions`.
#[derive(Debug, Clone)]
pub enum RequestInput {
    /// A completion prompt (with `--endpoint chat` it becomes one user message).
    Prompt(String),
    /// A completion prompt as token ids (`--tokenize-prompt`; completions only).
    TokenIds(Vec<u32>),
    /// A chat conversation.
    Messages(Vec<ChatMessage>),
}

/// The body of a streaming request for `max_tokens` tokens, asking for usage.
pub fn request_body(
    endpoint: Endpoint,
    model: &str,
    input: RequestInput,
    max_tokens: u64,
    ignore_eos: bool,
    extra: Map<String, Value>,
) -> Value {
    let generation = GenerationParams {
        max_tokens: Some(max_tokens as i64),
        ignore_eos: ignore_eos.then_some(true),
        ..Default::default()
    };
    let transport = TransportParams {
        stream: Some(true),
        stream_options: Some(StreamOptions {
            include_usage: Some(true),
            extra: Map::new(),
        }),
        ..Default::default()
    };
    let prompt = match (endpoint, input) {
        (Endpoint::Completions, RequestInput::Prompt(text)) => Ok(Prompt::Text(text)),
        (Endpoint::Completions, RequestInput::TokenIds(ids)) => Ok(Prompt::Tokens(ids)),
        (_, input) => Err(input),
    };
    let body = match prompt {
        Ok(prompt) => serde_json::to_value(CompletionRequest {
            model: Some(model.to_string()),
            prompt,
            logprobs: None,
            echo: None,
            generation,
            transport,
            extra,
            verbatim_numbers: Vec::new(),
        }),
        Err(input) => {
            let messages = match input {
                RequestInput::Messages(m) => m,
                RequestInput::Prompt(p) => vec![chat_message("user", p)],
                // `Workload::load` refuses `--tokenize-prompt` with chat; were ids to get
                // here, the server's 400 for an empty conversation would say so.
                RequestInput::TokenIds(_) => Vec::new(),
            };
            serde_json::to_value(ChatCompletionRequest {
                model: Some(model.to_string()),
                messages,
                logprobs: None,
                top_logprobs: None,
                generation,
                transport,
                extra,
                verbatim_numbers: Vec::new(),
            })
        }
    };
    // Our own types always serialize.
    body.unwrap_or(Value::Null)
}

/// A chat message with plain-text content.
pub fn chat_message(role: &str, text: String) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: Some(MessageContent::Text(text)),
        extra: Map::new(),
    }
}

/// An HTTP client bound to one server.
#[derive(Debug, Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    request_timeout: Duration,
}

impl ApiClient {
    /// One client per `--url`, sharing a connection pool, with bounded connect and
    /// request timeouts.
    pub fn replicas(args: &ServerArgs) -> Result<Vec<Self>, BenchError> {
        let first = Self::new(args)?;
        args.url
            .iter()
            .map(|url| {
                Ok(Self {
                    base: normalize_base_url(url)?,
                    ..first.clone()
                })
            })
            .collect()
    }

    /// A client for the first `--url` with bounded connect and request timeouts.
    pub fn new(args: &ServerArgs) -> Result<Self, BenchError> {
        let first = args.url.first().map(String::as_str).unwrap_or_default();
        let base = normalize_base_url(first)?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs_f64(args.connect_timeout_s))
            .tcp_nodelay(true)
            // pdserve closes idle keep-alive connections after its header read timeout
            // (30 s by default): retire ours first so a reused one never races that close.
            .pool_idle_timeout(Duration::from_secs(20))
            .build()
            .map_err(|e| BenchError::Http(error_chain(&e)))?;
        Ok(Self {
            http,
            base,
            api_key: args.api_key.clone(),
            request_timeout: Duration::from_secs_f64(args.request_timeout_s),
        })
    }

    /// The base URL (scheme, host, port and any path prefix; no trailing `/v1`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The first model id from `GET /v1/models`.
    pub async fn first_model(&self) -> Result<String, BenchError> {
        let url = format!("{}/v1/models", self.base);
        let mut req = self.http.get(&url).timeout(self.request_timeout);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() || e.is_timeout() {
                BenchError::Unreachable {
                    url: self.base.clone(),
                    reason: error_chain(&e),
                }
            } else {
                BenchError::Http(error_chain(&e))
            }
        })?;
        let status = resp.status();
        let content_type = content_type(&resp);
        let body = resp
            .text()
            .await
            .map_err(|e| BenchError::Http(error_chain(&e)))?;
        if !status.is_success() {
            return Err(BenchError::NotOpenAi {
                url,
                reason: format!(
                    "HTTP {status} with {content_type}: {}",
                    error_message(&body)
                ),
            });
        }
        let list: ModelList = serde_json::from_str(&body).map_err(|e| BenchError::NotOpenAi {
            url: url.clone(),
            reason: format!(
                "expected a JSON model list, got {content_type} ({e}): {}",
                snippet(&body)
            ),
        })?;
        list.data
            .into_iter()
            .next()
            .map(|m| m.id)
            .ok_or(BenchError::NoModels(url))
    }

    /// Sends `body` to `endpoint` and reads the event stream to its end.
    pub async fn stream(
        &self,
        endpoint: Endpoint,
        body: &Value,
    ) -> Result<StreamRecord, RequestError> {
        self.bounded(self.stream_inner(endpoint, body)).await
    }

    /// Runs one request under `--request-timeout-s`.
    pub(crate) async fn bounded<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, RequestError>>,
    ) -> Result<T, RequestError> {
        let timeout = self.request_timeout;
        match tokio::time::timeout(timeout, request).await {
            Ok(result) => result,
            Err(_) => Err(RequestError::Timeout(timeout.as_secs_f64())),
        }
    }

    /// Posts `body` to `path` (under the base URL), accepting `accept`; the answer if
    /// its status is a success, and when the request was sent.
    async fn post(
        &self,
        path: &str,
        body: &Value,
        accept: &'static str,
    ) -> Result<(reqwest::Response, Instant), RequestError> {
        let url = format!("{}{}", self.base, path);
        let mut req = self
            .http
            .post(&url)
            .header(reqwest::header::ACCEPT, accept)
            .json(body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let start = Instant::now();
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() {
                RequestError::Connect(error_chain(&e))
            } else {
                RequestError::Stream(error_chain(&e))
            }
        })?;
        let status = resp.status();
        if status.is_success() {
            return Ok((resp, start));
        }
        let content_type = content_type(&resp);
        let body = resp.text().await.unwrap_or_default();
        // An error page (e.g. a web server's 404) means this is no OpenAI API at all.
        if content_type.contains("html") && serde_json::from_str::<ErrorBody>(&body).is_err() {
            return Err(RequestError::NotOpenAi(format!(
                "HTTP {status} with {content_type}: {}",
                snippet(&body)
            )));
        }
        Err(RequestError::Status {
            status: status.as_u16(),
            message: error_message(&body),
        })
    }

    /// Posts a streaming request to `path`: the answer once its status and content type
    /// say it is an event stream, and when the request was sent.
    pub(crate) async fn open_stream(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<(reqwest::Response, Instant), RequestError> {
        let (resp, start) = self.post(path, body, "text/event-stream").await?;
        let content_type = content_type(&resp);
        if !content_type.starts_with("text/event-stream") {
            let body = resp.text().await.unwrap_or_default();
            return Err(RequestError::NotOpenAi(format!(
                "expected text/event-stream, got {content_type}: {}",
                snippet(&body)
            )));
        }
        Ok((resp, start))
    }

    /// Posts a non-streaming request to `path` and reads its JSON answer.
    pub(crate) async fn post_json(&self, path: &str, body: &Value) -> Result<Value, RequestError> {
        let (resp, _) = self.post(path, body, "application/json").await?;
        let content_type = content_type(&resp);
        let text = resp
            .text()
            .await
            .map_err(|e| RequestError::Stream(error_chain(&e)))?;
        serde_json::from_str(&text).map_err(|_| {
            RequestError::NotOpenAi(format!(
                "expected JSON, got {content_type}: {}",
                snippet(&text)
            ))
        })
    }

    async fn stream_inner(
        &self,
        endpoint: Endpoint,
        body: &Value,
    ) -> Result<StreamRecord, RequestError> {
        let (resp, start) = self.open_stream(endpoint.path(), body).await?;
        let mut record = StreamRecord {
            ttft: Duration::ZERO,
            e2e: Duration::ZERO,
            chunk_offsets: Vec::new(),
            usage: None,
            text: String::new(),
        };
        let mut messages = std::pin::pin!(sse::messages(resp.bytes_stream()));
        let mut done = false;
        while let Some(message) = messages.next().await {
            let data = match message.map_err(|e| RequestError::Stream(e.to_string()))? {
                SseMessage::Done => {
                    done = true;
                    break;
                }
                SseMessage::Data(data) => data,
            };
            let now = start.elapsed();
            let chunk: Value = serde_json::from_str(&data).map_err(|_| {
                RequestError::NotOpenAi(format!("event is not JSON: {}", snippet(&data)))
            })?;
            if let Some(error) = chunk.get("error") {
                return Err(RequestError::ErrorEvent(event_error_message(error)));
            }
            if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                record.usage = serde_json::from_value(usage.clone()).ok();
            }
            let text = chunk_text(&chunk);
            if !text.is_empty() {
                record.chunk_offsets.push(now);
                record.text.push_str(text);
            }
        }
        if !done {
            return Err(RequestError::Stream("ended before `data: [DONE]`".into()));
        }
        record.e2e = start.elapsed();
        record.ttft = *record.chunk_offsets.first().ok_or(RequestError::Empty)?;
        Ok(record)
    }
}

/// The text a chunk adds: the first choice's `text`, `delta.content` or
/// `delta.reasoning_content`.
fn chunk_text(chunk: &Value) -> &str {
    let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
        return "";
    };
    if let Some(text) = choice.get("text").and_then(Value::as_str) {
        return text;
    }
    let delta = choice.get("delta");
    ["content", "reasoning_content"]
        .iter()
        .filter_map(|k| delta.and_then(|d| d.get(*k)).and_then(Value::as_str))
        .find(|s| !s.is_empty())
        .unwrap_or("")
}

/// `http://host:port` from what a user typed: trailing `/` and `/v1` removed.
fn normalize_base_url(url: &str) -> Result<String, BenchError> {
    let parsed = reqwest::Url::parse(url.trim()).map_err(|e| BenchError::BadUrl {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    if parsed.scheme() != "http" {
        return Err(BenchError::BadUrl {
            url: url.to_string(),
            reason: "only http:// URLs are supported (put a TLS-terminating proxy in front)".into(),
        });
    }
    let mut base = parsed.as_str().trim_end_matches('/').to_string();
    if let Some(stripped) = base.strip_suffix("/v1") {
        base = stripped.to_string();
    }
    Ok(base)
}

fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("no content type")
        .to_string()
}

/// The message of an OpenAI error body, or the start of the body.
fn error_message(body: &str) -> String {
    match serde_json::from_str::<ErrorBody>(body) {
        Ok(e) => e.error.message,
        Err(_) if body.trim().is_empty() => "empty body".to_string(),
        Err(_) => snippet(body),
    }
}

/// The message of an in-stream `error` value (an object with `message`, or a string).
pub(crate) fn event_error_message(error: &Value) -> String {
    error
        .get("message")
        .and_then(Value::as_str)
        .or_else(|| error.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| error.to_string())
}

/// The first line of `text`, at most 120 characters, for error messages.
pub(crate) fn snippet(text: &str) -> String {
    let line = text.trim().lines().next().unwrap_or("");
    let mut s: String = line.chars().take(120).collect();
    if s.len() < line.len() {
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn base_url_drops_v1_and_slashes() {
        for url in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/",
        ] {
            assert_eq!(normalize_base_url(url).unwrap(), "http://h:1");
        }
        assert_eq!(
            normalize_base_url("http://h:1/api/v1").unwrap(),
            "http://h:1/api"
        );
        assert!(normalize_base_url("localhost:8000").is_err());
        assert!(normalize_base_url("https://h").is_err());
    }

    #[test]
    fn chunk_text_reads_both_formats_and_skips_role_chunks() {
        assert_eq!(chunk_text(&json!({"choices": [{"text": " a"}]})), " a");
        assert_eq!(
            chunk_text(&json!({"choices": [{"delta": {"content": "b"}}]})),
            "b"
        );
        assert_eq!(
            chunk_text(&json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]})),
            ""
        );
        assert_eq!(
            chunk_text(&json!({"choices": [{"delta": {"reasoning_content": "r"}}]})),
            "r"
        );
        assert_eq!(chunk_text(&json!({"choices": [], "usage": {}})), "");
    }

    #[test]
    fn bodies_ask_for_usage_and_fixed_length() {
        let body = request_body(
            Endpoint::Completions,
            "m",
            RequestInput::Prompt("p".into()),
            7,
            true,
            Map::new(),
        );
        assert_eq!(body["prompt"], "p");
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        let mut extra = Map::new();
        extra.insert("conversation_id".into(), json!("c"));
        let body = request_body(
            Endpoint::Chat,
            "m",
            RequestInput::Prompt("p".into()),
            7,
            false,
            extra,
        );
        assert_eq!(body["messages"], json!([{"role": "user", "content": "p"}]));
        assert!(body.get("ignore_eos").is_none());
        assert_eq!(body["conversation_id"], "c");
        let body = request_body(
            Endpoint::Completions,
            "m",
            RequestInput::TokenIds(vec![5, 0, 49_151]),
            7,
            true,
            Map::new(),
        );
        assert_eq!(body["prompt"], json!([5, 0, 49_151]), "ids go as an array");
    }

    #[test]
    fn tpot_and_itl_come_from_chunk_times() {
        let ms = Duration::from_millis;
        let r = StreamRecord {
            ttft: ms(50),
            e2e: ms(100),
            chunk_offsets: vec![ms(50), ms(70), ms(90)],
            usage: None,
            text: String::new(),
        };
        assert_eq!(r.output_tokens(), 3);
        assert_eq!(r.inter_token_latencies(), vec![ms(20), ms(20)]);
        assert_eq!(r.tpot(), Some(ms(25)));
    }
}
