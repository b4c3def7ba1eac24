//! `POST /v1/chat/completions`: messages rendered with the model's chat template.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::HeaderMap;
use pdserve_model::{chat_turns, ChatTurn};
use pdserve_protocol::{
    sse, unix_now, ApiError, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
    ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage,
    KvTransferParams, MessageContent, TokenLogprob, TopLogprob, Usage,
};

use super::body::parse_json;
use super::prepared::{serve, session_key, Prepared, PromptRun, Reply};
use super::response_format::{response_id, ChoiceOutput, ResolvedLogprob, ResponseFormat};
use super::unsupported::check_unsupported;
use super::validate::{
    boolean_field, check_model, choice_count, generation_request, output_options, request_priority,
    return_token_ids, top_logprobs,
};
use super::AppState;

/// Handles one chat completion request. Errors become OpenAI-shaped responses through
/// `ApiError`'s `IntoResponse`.
pub async fn handle(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_json(body)?;
    let prepared = prepare(&app, req, &headers).await?;
    Ok(serve(&app, prepared).await)
}

/// Checks `req`, renders its messages with the chat template and tokenizes them.
async fn prepare(
    app: &Arc<AppState>,
    req: ChatCompletionRequest,
    headers: &HeaderMap,
) -> Result<Prepared<ChatFormat>, ApiError> {
    check_model(req.model.as_deref(), &app.serving.limits)?;
    check_unsupported(&req.extra)?;
    let mut options = output_options(&req.transport, &req.generation)?;
    options.return_token_ids = return_token_ids(&req.extra, options.stream)?;
    let first_token_from_prefill = boolean_field(&req.extra, "first_token_from_prefill")?;
    let choices = choice_count(req.generation.n)?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = match req.top_logprobs {
        Some(n) if n > 0 && !want_logprobs => {
            return Err(
                ApiError::bad_request("top_logprobs requires logprobs to be true")
                    .with_param("top_logprobs"),
            )
        }
        Some(n) => top_logprobs("top_logprobs", n)?,
        None => 0,
    };
    let turns = chat_turns(&req.messages)?;
    let prompt = chat_prompt(app, turns).await?;
    let max_tokens = req
        .generation
        .max_completion_tokens
        .or(req.generation.max_tokens);
    let mut request = generation_request(
        prompt,
        &req.generation,
        max_tokens,
        want_logprobs.then_some(top),
        &app.serving.limits,
        "messages",
    )?;
    request.priority = request_priority(&req.extra)?;
    let format = ChatFormat::new(app.serving.limits.served_model_name.clone());
    Ok(Prepared {
        prompts: vec![PromptRun::plain(request)],
        session: session_key(headers, &req.extra),
        first_token_from_prefill,
        bootstrap: crate::bootstrap::fields(&req.transport, choices)?,
        choices,
        kv_transfer_params: req.transport.kv_transfer_params,
        model: req.model,
        reply: Reply::new(format, &options, want_logprobs),
        stop: options.stop,
    })
}

/// `turns` rendered with the chat template (generation prompt added) and tokenized, off
/// the async runtime; counted as a tokenized prompt.
pub(super) async fn chat_prompt(
    app: &Arc<AppState>,
    turns: Vec<ChatTurn>,
) -> Result<Vec<u32>, ApiError> {
    let model = app.serving.text.clone();
    let prompt = tokio::task::spawn_blocking(move || {
        let text = model
            .chat_template()
            .render(&turns, true)
            .map_err(|e| ApiError::bad_request(format!("cannot apply the chat template: {e}")))?;
        model
            .tokenizer()
            .encode(&text, false)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))??;
    app.serving.metrics.prompts_tokenized.inc();
    Ok(prompt)
}

fn token_logprob(lp: ResolvedLogprob) -> TokenLogprob {
    TokenLogprob {
        token: String::from_utf8_lossy(&lp.bytes).into_owned(),
        logprob: lp.logprob,
        bytes: Some(lp.bytes),
        top_logprobs: lp
            .top
            .into_iter()
            .map(|(bytes, logprob)| TopLogprob {
                token: String::from_utf8_lossy(&bytes).into_owned(),
                logprob,
                bytes: Some(bytes),
            })
            .collect(),
    }
}

/// How chat answers are shaped.
pub(super) struct ChatFormat {
    id: String,
    created: u64,
    model: String,
}

impl ChatFormat {
    /// A fresh response id, created now, for `model`.
    fn new(model: String) -> Self {
        Self {
            id: response_id("chatcmpl"),
            created: unix_now(),
            model,
        }
    }

    fn chunk(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Usage>,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Bytes {
        sse::data_event(&ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params,
            extra: Default::default(),
        })
    }

    fn choice(
        index: u32,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&str>,
    ) -> ChatChunkChoice {
        ChatChunkChoice {
            index,
            delta,
            logprobs,
            finish_reason: finish.map(str::to_string),
        }
    }
}

impl ResponseFormat for ChatFormat {
    fn start_chunk(&self, index: u32) -> Option<Bytes> {
        let delta = ChatDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
            ..Default::default()
        };
        Some(self.chunk(vec![Self::choice(index, delta, None, None)], None, None))
    }

    fn text_chunk(&self, index: u32, text: String, logprob: Option<ResolvedLogprob>) -> Bytes {
        let delta = ChatDelta {
            content: Some(text),
            ..Default::default()
        };
        let logprobs = logprob.map(|lp| ChatLogprobs {
            content: vec![token_logprob(lp)],
        });
        self.chunk(vec![Self::choice(index, delta, logprobs, None)], None, None)
    }

    fn finish_chunk(
        &self,
        index: u32,
        finish_reason: &'static str,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Bytes {
        self.chunk(
            vec![Self::choice(
                index,
                ChatDelta::default(),
                None,
                Some(finish_reason),
            )],
            None,
            kv_transfer_params,
        )
    }

    fn usage_chunk(&self, usage: Usage) -> Bytes {
        self.chunk(Vec::new(), Some(usage), None)
    }

    fn response(
        &self,
        choices: Vec<ChoiceOutput>,
        usage: Usage,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Response {
        let choices = choices
            .into_iter()
            .zip(0..)
            .map(|(choice, index)| ChatChoice {
                index,
                message: ChatMessage {
                    role: "assistant".into(),
                    content: Some(MessageContent::Text(choice.text)),
                    extra: Default::default(),
                },
                logprobs: choice.logprobs.map(|lps| ChatLogprobs {
                    content: lps.into_iter().map(token_logprob).collect(),
                }),
                finish_reason: Some(choice.finish_reason.into()),
                extra: choice
                    .token_ids
                    .map(|ids| serde_json::Map::from_iter([("token_ids".into(), ids.into())]))
                    .unwrap_or_default(),
            })
            .collect();
        Json(ChatCompletionResponse {
            id: self.id.clone(),
            object: "chat.completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: Some(usage),
            kv_transfer_params,
            extra: Default::default(),
        })
        .into_response()
    }
}
