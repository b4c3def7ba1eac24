//! vLLM's `POST /tokenize` and `POST /detokenize`. With `--tokenizer` the gateway answers
//! them itself, with the workers' tokenizer and template, once a worker's model list has
//! said the served model's name and context length; otherwise, and for chats with content
//! it does not render (non-text parts), a worker answers and its reply is passed through.

// ApiError is the error every route answers with; boxing it here alone would gain nothing.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::HeaderMap;
use pdserve_model::{ChatTurn, PromptInput};
use pdserve_protocol::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use pdserve_protocol::{ApiError, ChatMessage, MessageContent};
use serde_json::Value;

use crate::clients::worker_client::{Exchange, ForwardHeaders};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::prompt_tokens::PromptTokenizer;
use crate::ingress::request::body_rejection;
use crate::policy::RouteRequest;
use crate::state::AppState;

/// What the gateway knows of the served model, to answer on its own.
struct Served {
    tokenizer: Arc<PromptTokenizer>,
    names: Vec<String>,
    max_model_len: u64,
}

impl Served {
    /// 404 for a model this deployment does not serve, as the worker would answer.
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if !self.names.iter().any(|n| n == m) => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

/// A live worker to ask (decode first, as for `/v1/models`).
fn any_worker(state: &AppState, headers: &HeaderMap) -> Result<Arc<Worker>, Failure> {
    state
        .pick_any(&RouteRequest::bodyless(Endpoint::Chat, headers))
        .ok_or_else(|| state.refuse_any().into())
}

/// The gateway's tokenizer and what a worker said of the model, when it has both.
fn served(state: &AppState, worker: &Arc<Worker>) -> Option<Served> {
    let tokenizer = state.tokenizer.clone()?;
    let max_model_len = state.model_lens.get(&state.client, worker)?;
    let names = state.model_lens.names(worker)?;
    Some(Served {
        tokenizer,
        names,
        max_model_len,
    })
}

fn read_body(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| body_rejection(r, state.config.max_body_bytes))
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

/// `POST /tokenize`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let response = match answer_tokenize(&state, &headers, body).await {
        Ok(response) => response,
        Err(failure) => failure.into_response(),
    };
    state
        .metrics
        .record_request("/tokenize", response.status().as_u16());
    response
}

async fn answer_tokenize(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Failure> {
    let body = read_body(state, body)?;
    let worker = any_worker(state, headers)?;
    let Some(served) = served(state, &worker) else {
        return forward(state, headers, &worker, "/tokenize", body).await;
    };
    let request = TokenizeRequest::from_value(parse::<Value>(&body)?)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    served.check_model(request.model())?;
    if let TokenizeRequest::Chat(chat) = &request {
        if !text_only(&chat.messages) {
            return forward(state, headers, &worker, "/tokenize", body).await;
        }
    }
    let tokenizer = served.tokenizer.clone();
    let (tokens, token_strs) = tokio::task::spawn_blocking(move || tokens_of(&tokenizer, &request))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))??;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: served.max_model_len as usize,
        tokens,
        token_strs,
    })
    .into_response())
}

/// Whether every message is plain text (what the gateway's template renders alike).
fn text_only(messages: &[ChatMessage]) -> bool {
    messages.iter().all(|m| match &m.content {
        Some(MessageContent::Parts(parts)) => parts
            .iter()
            .all(|p| p.get("type").and_then(Value::as_str) == Some("text")),
        _ => true,
    })
}

fn tokens_of(
    tokenizer: &PromptTokenizer,
    request: &TokenizeRequest,
) -> Result<(Vec<u32>, Option<Vec<String>>), ApiError> {
    let turns: Vec<ChatTurn>;
    let (input, param) = match request {
        TokenizeRequest::Completion(r) => (
            PromptInput::Text {
                text: &r.prompt,
                add_special_tokens: r.add_special_tokens,
            },
            "prompt",
        ),
        TokenizeRequest::Chat(r) => {
            if r.messages.is_empty() {
                return Err(
                    ApiError::bad_request("messages must not be empty").with_param("messages")
                );
            }
            turns = crate::ingress::prompt_tokens::chat_turns(&r.messages);
            (
                PromptInput::Chat {
                    turns: &turns,
                    add_generation_prompt: r.add_generation_prompt,
                    continue_final_message: r.continue_final_message,
                    add_special_tokens: r.add_special_tokens,
                },
                "messages",
            )
        }
    };
    let tokens = pdserve_model::tokenize(tokenizer.tokenizer(), tokenizer.template(), input)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize: {e}")).with_param(param))?;
    let strs = request.return_token_strs().then(|| {
        tokens
            .iter()
            .map(|&id| tokenizer.tokenizer().id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok((tokens, strs))
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let response = match answer_detokenize(&state, &headers, body).await {
        Ok(response) => response,
        Err(failure) => failure.into_response(),
    };
    state
        .metrics
        .record_request("/detokenize", response.status().as_u16());
    response
}

async fn answer_detokenize(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Failure> {
    let body = read_body(state, body)?;
    let worker = any_worker(state, headers)?;
    let Some(served) = served(state, &worker) else {
        return forward(state, headers, &worker, "/detokenize", body).await;
    };
    let request: DetokenizeRequest = parse(&body)?;
    served.check_model(request.model.as_deref())?;
    let tokenizer = served.tokenizer.tokenizer();
    let vocab = tokenizer.vocab_size();
    if let Some(bad) = request.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is out of vocabulary (size {vocab})"
        ))
        .with_param("tokens")
        .into());
    }
    let prompt = tokenizer.decode(&request.tokens, false).map_err(|e| {
        ApiError::bad_request(format!("cannot detokenize: {e}")).with_param("tokens")
    })?;
    Ok(Json(DetokenizeResponse { prompt }).into_response())
}

/// Sends `body` to `worker`'s `path` and passes its JSON answer (or its 4xx) through.
async fn forward(
    state: &AppState,
    headers: &HeaderMap,
    worker: &Arc<Worker>,
    path: &str,
    body: Bytes,
) -> Result<Response, Failure> {
    let url = reqwest::Url::parse(&format!("{}{path}", worker.base.trim_end_matches('/')))
        .map_err(|e| ApiError::internal(format!("no {path} URL for {}: {e}", worker.base)))?;
    let exchange = Exchange::new(worker, "worker", state.config.decode_timeout);
    let request = state
        .client
        .post_json(&url, body, &ForwardHeaders::from_client(headers));
    match exchange.send_and_read(request).await {
        Ok(answer) => {
            Ok(([(http::header::CONTENT_TYPE, "application/json")], answer).into_response())
        }
        Err(e) => {
            state.report(worker, &e);
            Err(e.failure)
        }
    }
}
