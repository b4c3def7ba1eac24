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
use pdserve_model::{chat_turns, tokenize_request};
use pdserve_protocol::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use pdserve_protocol::ApiError;
use serde_json::Value;

use crate::clients::worker_client::{Exchange, ForwardHeaders};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::ingress::prompt_tokens::PromptTokenizer;
use crate::ingress::request::body_rejection;
use crate::policy::RouteRequest;
use crate::serving::Serving;

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
fn any_worker(state: &Serving, headers: &HeaderMap) -> Result<Arc<Worker>, Failure> {
    state
        .pick_any(&RouteRequest::bodyless(Endpoint::Chat, headers))
        .ok_or_else(|| state.refuse_any().into())
}

/// The gateway's tokenizer and what a worker said of the model, when it has both.
fn served(state: &Serving, worker: &Arc<Worker>) -> Option<Served> {
    let tokenizer = state.tokenizer.clone()?;
    let max_model_len = state.model_lens.get(&state.client, worker)?;
    let names = state.model_lens.names(worker)?;
    Some(Served {
        tokenizer,
        names,
        max_model_len,
    })
}

fn read_body(state: &Serving, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| body_rejection(r, state.settings.max_body_bytes))
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

/// The response for `route`, counted in the request metrics.
fn counted(state: &Serving, route: &str, answer: Result<Response, Failure>) -> Response {
    let response = answer.unwrap_or_else(IntoResponse::into_response);
    state
        .metrics
        .record_request(route, response.status().as_u16());
    response
}

/// The body, the worker that would answer, and what the gateway needs to answer itself
/// (`None`: forward to the worker).
fn intake(
    state: &Serving,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Bytes, Arc<Worker>, Option<Served>), Failure> {
    let body = read_body(state, body)?;
    let worker = any_worker(state, headers)?;
    let served = served(state, &worker);
    Ok((body, worker, served))
}

/// `POST /tokenize`.
pub async fn tokenize(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = answer_tokenize(&state, &headers, body).await;
    counted(&state, "/tokenize", answer)
}

async fn answer_tokenize(
    state: &Serving,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Failure> {
    let (body, worker, served) = intake(state, headers, body)?;
    let Some(served) = served else {
        return forward(state, headers, &worker, "/tokenize", body).await;
    };
    let request = TokenizeRequest::from_value(parse::<Value>(&body)?)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    served.check_model(request.model())?;
    // Media parts render differently on a multimodal worker: let it answer.
    if let TokenizeRequest::Chat(chat) = &request {
        if chat_turns(&chat.messages).is_err() && !chat.messages.is_empty() {
            return forward(state, headers, &worker, "/tokenize", body).await;
        }
    }
    let tokenizer = served.tokenizer.clone();
    let (tokens, token_strs) = tokio::task::spawn_blocking(move || {
        tokenize_request(tokenizer.tokenizer(), tokenizer.template(), &request)
    })
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

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<Arc<Serving>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = answer_detokenize(&state, &headers, body).await;
    counted(&state, "/detokenize", answer)
}

async fn answer_detokenize(
    state: &Serving,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Failure> {
    let (body, worker, served) = intake(state, headers, body)?;
    let Some(served) = served else {
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
    state: &Serving,
    headers: &HeaderMap,
    worker: &Arc<Worker>,
    path: &str,
    body: Bytes,
) -> Result<Response, Failure> {
    let url = reqwest::Url::parse(&format!("{}{path}", worker.base.trim_end_matches('/')))
        .map_err(|e| ApiError::internal(format!("no {path} URL for {}: {e}", worker.base)))?;
    let exchange = Exchange::new(worker, "worker", state.settings.decode_timeout);
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
