//! `POST /tokenize` and `POST /detokenize` with vLLM's shapes: a text prompt or chat
//! messages in, the token ids this worker would compute out (and their spellings with
//! `return_token_strs`); token ids in, their text out.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use pdserve_model::tokenize_request;
use pdserve_protocol::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use pdserve_protocol::ApiError;
use serde_json::Value;

use super::body::parse_json;
use super::validate::check_model;
use super::AppState;

/// Tokenizes a prompt or a chat.
pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let body: Value = parse_json(body)?;
    let request = TokenizeRequest::from_value(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    check_model(request.model(), &app.serving.limits)?;
    let model = app.serving.text.clone();
    let (tokens, token_strs) = tokio::task::spawn_blocking(move || {
        tokenize_request(model.tokenizer(), model.chat_template(), &request)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))??;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: app.serving.limits.max_model_len,
        tokens,
        token_strs,
    }))
}

/// The text of token ids (special tokens kept, as vLLM does).
pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let request: DetokenizeRequest = parse_json(body)?;
    check_model(request.model.as_deref(), &app.serving.limits)?;
    let vocab = app.serving.text.tokenizer().vocab_size();
    if let Some(bad) = request.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is out of vocabulary (size {vocab})"
        ))
        .with_param("tokens"));
    }
    let model = app.serving.text.clone();
    let prompt =
        tokio::task::spawn_blocking(move || model.tokenizer().decode(&request.tokens, false))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
            .map_err(|e| {
                ApiError::bad_request(format!("cannot detokenize: {e}")).with_param("tokens")
            })?;
    Ok(Json(DetokenizeResponse { prompt }))
}
