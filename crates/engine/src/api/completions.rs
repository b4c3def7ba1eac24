//! `POST /v1/completions`: a raw prompt (text or token ids) continued.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::HeaderMap;
use pdserve_protocol::{
    sse, unix_now, ApiError, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, KvTransferParams, Prompt, Usage,
};
use serde_json::{Map, Value};

use super::body::parse_json;
use super::prepared::{serve, session_key, Prepared, Reply};
use super::response_format::{response_id, ChoiceOutput, ResolvedLogprob, ResponseFormat};
use super::unsupported::check_unsupported;
use super::validate::{
    check_model, choice_count, generation_request, output_options, top_logprobs,
};
use super::AppState;

/// Handles one completion request. Errors become OpenAI-shaped responses through
/// `ApiError`'s `IntoResponse`.
pub async fn handle(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let prepared = prepare(&app, req, &headers).await?;
    Ok(serve(&app, prepared).await)
}

/// Checks `req` and tokenizes its prompt (a token-id prompt is taken as it is).
async fn prepare(
    app: &Arc<AppState>,
    req: CompletionRequest,
    headers: &HeaderMap,
) -> Result<Prepared, ApiError> {
    check_model(req.model.as_deref(), &app.serving.limits)?;
    check_unsupported(&req.extra)?;
    let options = output_options(&req.transport, &req.generation)?;
    let choices = choice_count(req.generation.n)?;
    if req.echo == Some(true) {
        return Err(
            ApiError::bad_request("echo is not supported by this worker").with_param("echo"),
        );
    }
    let logprobs = req
        .logprobs
        .map(|n| top_logprobs("logprobs", n))
        .transpose()?;
    let prompt = match req.prompt {
        Prompt::Text(text) => tokenize(app, text).await?,
        Prompt::Texts(mut texts) if texts.len() == 1 => tokenize(app, texts.remove(0)).await?,
        Prompt::Tokens(ids) => ids,
        Prompt::TokenBatches(mut batches) if batches.len() == 1 => batches.remove(0),
        Prompt::Texts(_) | Prompt::TokenBatches(_) => {
            return Err(ApiError::bad_request(
                "exactly one prompt per request is supported (send several requests)",
            )
            .with_param("prompt"))
        }
    };
    let request = generation_request(
        prompt,
        &req.generation,
        req.generation.max_tokens,
        logprobs,
        &app.serving.limits,
        "prompt",
    )?;
    let format = CompletionFormat::new(app.serving.limits.served_model_name.clone());
    Ok(Prepared {
        request,
        session: session_key(headers, &req.extra),
        bootstrap: crate::bootstrap::fields(&req.transport, choices)?,
        choices,
        kv_transfer_params: req.transport.kv_transfer_params,
        model: req.model,
        reply: Reply::completion(format, &options, logprobs.is_some()),
        stop: options.stop,
    })
}

async fn tokenize(app: &Arc<AppState>, text: String) -> Result<Vec<u32>, ApiError> {
    let model = app.serving.model.clone();
    let ids = tokio::task::spawn_blocking(move || model.tokenizer().encode(&text, true))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?;
    app.serving.metrics.prompts_tokenized.inc();
    Ok(ids)
}

/// The legacy columnar logprobs of `lps`.
fn completion_logprobs(lps: Vec<ResolvedLogprob>) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        out.tokens
            .push(String::from_utf8_lossy(&lp.bytes).into_owned());
        out.token_logprobs.push(Some(lp.logprob));
        let top: Map<String, Value> = lp
            .top
            .into_iter()
            .map(|(bytes, l)| (String::from_utf8_lossy(&bytes).into_owned(), Value::from(l)))
            .collect();
        out.top_logprobs.push(Some(top));
        out.text_offset.push(lp.text_offset as u32);
    }
    out
}

/// How completion answers are shaped.
pub(super) struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
}

impl CompletionFormat {
    /// A fresh response id, created now, for `model`.
    fn new(model: String) -> Self {
        Self {
            id: response_id("cmpl"),
            created: unix_now(),
            model,
        }
    }

    fn body(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Usage>,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params,
            extra: Default::default(),
        }
    }

    fn choice(
        index: u32,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<&str>,
    ) -> CompletionChoice {
        CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: finish.map(str::to_string),
            extra: Default::default(),
        }
    }
}

impl ResponseFormat for CompletionFormat {
    fn start_chunk(&self, _index: u32) -> Option<Bytes> {
        None
    }

    fn text_chunk(&self, index: u32, text: String, logprob: Option<ResolvedLogprob>) -> Bytes {
        let logprobs = logprob.map(|lp| completion_logprobs(vec![lp]));
        let choice = Self::choice(index, text, logprobs, None);
        sse::data_event(&self.body(vec![choice], None, None))
    }

    fn finish_chunk(
        &self,
        index: u32,
        finish_reason: &'static str,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Bytes {
        sse::data_event(&self.body(
            vec![Self::choice(
                index,
                String::new(),
                None,
                Some(finish_reason),
            )],
            None,
            kv_transfer_params,
        ))
    }

    fn usage_chunk(&self, usage: Usage) -> Bytes {
        sse::data_event(&self.body(Vec::new(), Some(usage), None))
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
            .map(|(c, index)| {
                let logprobs = c.logprobs.map(completion_logprobs);
                Self::choice(index, c.text, logprobs, Some(c.finish_reason))
            })
            .collect();
        Json(self.body(choices, Some(usage), kv_transfer_params)).into_response()
    }
}
