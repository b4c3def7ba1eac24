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
use serde_json::{json, Map, Value};

use super::body::parse_json;
use super::prepared::{serve, session_key, Prepared, PromptRun, Reply};
use super::response_format::{response_id, ChoiceOutput, ResolvedLogprob, ResponseFormat};
use super::unsupported::check_unsupported;
use super::validate::{
    boolean_field, check_model, choice_count, generation_request, output_options, request_priority,
    return_token_ids, top_logprobs,
};
use super::AppState;
use crate::serving::{EchoPlan, PromptEcho, PromptScores};

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

/// Checks `req` and tokenizes its prompt(s) (token-id prompts are taken as they are).
async fn prepare(
    app: &Arc<AppState>,
    mut req: CompletionRequest,
    headers: &HeaderMap,
) -> Result<Prepared<CompletionFormat>, ApiError> {
    check_model(req.model.as_deref(), &app.serving.limits)?;
    let prompt_logprobs = match req.extra.remove("prompt_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => Some(top_logprobs(
            "prompt_logprobs",
            integer(&v, "prompt_logprobs")?,
        )?),
    };
    check_unsupported(&req.extra)?;
    let mut options = output_options(&req.transport, &req.generation)?;
    options.return_token_ids = return_token_ids(&req.extra, options.stream)?;
    let first_token_from_prefill = boolean_field(&req.extra, "first_token_from_prefill")?;
    let choices = choice_count(req.generation.n)?;
    let echo = req.echo == Some(true);
    let logprobs = req
        .logprobs
        .map(|n| top_logprobs("logprobs", n))
        .transpose()?;
    // `max_tokens` 0 scores the prompt only, which only an echo reports (as vLLM).
    let scores_only = req.generation.max_tokens == Some(0);
    if scores_only && !echo {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1 unless echo is true (prompt scoring)",
        )
        .with_param("max_tokens"));
    }
    if scores_only && req.generation.min_tokens.unwrap_or(0) > 0 {
        return Err(
            ApiError::bad_request("min_tokens must not exceed max_tokens (0)")
                .with_param("min_tokens"),
        );
    }
    let max_tokens = if scores_only {
        Some(1)
    } else {
        req.generation.max_tokens
    };
    // Echoed logprobs score the prompt with as many alternatives as the output's.
    let scored = match (echo, logprobs, prompt_logprobs) {
        (true, Some(n), Some(m)) => Some(n.max(m)),
        (true, Some(n), None) => Some(n),
        (_, _, m) => m,
    };
    let texts: Vec<Option<String>> = match &req.prompt {
        Prompt::Text(text) => vec![Some(text.clone())],
        Prompt::Texts(texts) => texts.iter().cloned().map(Some).collect(),
        Prompt::Tokens(_) => vec![None],
        Prompt::TokenBatches(batches) => vec![None; batches.len()],
    };
    let ids: Vec<Vec<u32>> = match req.prompt {
        Prompt::Text(text) => vec![tokenize(app, text).await?],
        Prompt::Texts(texts) => {
            let mut all = Vec::with_capacity(texts.len());
            for text in texts {
                all.push(tokenize(app, text).await?);
            }
            all
        }
        Prompt::Tokens(ids) => vec![ids],
        Prompt::TokenBatches(batches) => batches,
    };
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt list is empty").with_param("prompt"));
    }
    if ids.len() > MAX_BATCH_PROMPTS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_BATCH_PROMPTS} prompts per request, got {}",
            ids.len()
        ))
        .with_param("prompt"));
    }
    let priority = request_priority(&req.extra)?;
    let mut prompts = Vec::with_capacity(ids.len());
    for (prompt, text) in ids.into_iter().zip(texts) {
        let mut request = generation_request(
            prompt,
            &req.generation,
            max_tokens,
            logprobs,
            &app.serving.limits,
            "prompt",
        )?;
        request.priority = priority;
        if scores_only {
            request.max_new_tokens = 0;
        }
        request.prompt_logprobs = scored;
        let echo = (echo || prompt_logprobs.is_some()).then(|| EchoPlan {
            text: echo.then(|| text.unwrap_or_else(|| echo_text(app, &request.prompt))),
            ids: request.prompt.clone(),
            scores: if scored.is_some() {
                PromptScores::Computed
            } else {
                PromptScores::Unscored
            },
        });
        prompts.push(PromptRun { request, echo });
    }
    let format = CompletionFormat::new(
        app.serving.limits.served_model_name.clone(),
        EchoShape {
            logprobs: echo && logprobs.is_some(),
            prompt_logprobs,
        },
    );
    Ok(Prepared {
        prompts,
        session: session_key(headers, &req.extra),
        first_token_from_prefill,
        bootstrap: crate::bootstrap::fields(&req.transport, choices)?,
        choices,
        kv_transfer_params: req.transport.kv_transfer_params,
        model: req.model,
        reply: Reply::new(format, &options, logprobs.is_some()),
        stop: options.stop,
    })
}

/// Most prompts one completions request may carry.
const MAX_BATCH_PROMPTS: usize = 256;

/// An integer field, as JSON gives it (`1.0` is refused, as OpenAI does).
fn integer(value: &Value, param: &str) -> Result<i64, ApiError> {
    value.as_i64().ok_or_else(|| {
        ApiError::bad_request(format!("{param} must be an integer, got {value}")).with_param(param)
    })
}

/// The echoed text of a token-id prompt: its tokens decoded, special tokens included.
fn echo_text(app: &AppState, ids: &[u32]) -> String {
    app.serving
        .text
        .tokenizer()
        .decode(ids, false)
        .unwrap_or_default()
}

async fn tokenize(app: &Arc<AppState>, text: String) -> Result<Vec<u32>, ApiError> {
    let model = app.serving.text.clone();
    let ids = tokio::task::spawn_blocking(move || model.tokenizer().encode(&text, true))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?;
    app.serving.metrics.prompts_tokenized.inc();
    Ok(ids)
}

/// The legacy columnar logprobs of `lps`, appended to `out`.
fn completion_logprobs(out: &mut CompletionLogprobs, lps: Vec<ResolvedLogprob>) {
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
}

/// The echoed prompt's columnar logprobs: `null` where a token is not scored (the first;
/// all of them where the KV was imported), its alternatives with the token itself.
fn prompt_columns(out: &mut CompletionLogprobs, prompt: &PromptEcho) {
    for token in &prompt.tokens {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        out.tokens.push(text(&token.bytes));
        out.text_offset.push(token.text_offset as u32);
        match &token.score {
            None => {
                out.token_logprobs.push(None);
                out.top_logprobs.push(None);
            }
            Some(score) => {
                out.token_logprobs.push(Some(score.logprob));
                let mut top: Map<String, Value> = score
                    .top
                    .iter()
                    .map(|(_, bytes, l)| (text(bytes), Value::from(*l)))
                    .collect();
                top.entry(text(&token.bytes))
                    .or_insert(Value::from(score.logprob));
                out.top_logprobs.push(Some(top));
            }
        }
    }
}

/// vLLM's `prompt_logprobs`: per prompt token `null` (the first, or unscored) or a map
/// from token id to `logprob`, `rank` and `decoded_token`, holding the top alternatives
/// and the prompt token itself.
fn vllm_prompt_logprobs(prompt: &PromptEcho) -> Value {
    let entry = |logprob: f32, rank: u32, bytes: &[u8]| {
        json!({
            "logprob": logprob,
            "rank": rank,
            "decoded_token": String::from_utf8_lossy(bytes),
        })
    };
    let list = prompt
        .tokens
        .iter()
        .map(|token| match &token.score {
            None => Value::Null,
            Some(score) => {
                let mut map = Map::new();
                map.insert(
                    token.id.to_string(),
                    entry(score.logprob, score.rank, &token.bytes),
                );
                for (rank, (id, bytes, l)) in (1..).zip(&score.top) {
                    map.entry(id.to_string())
                        .or_insert_with(|| entry(*l, rank, bytes));
                }
                Value::Object(map)
            }
        })
        .collect();
    Value::Array(list)
}

/// What of the prompt a completion reports.
#[derive(Debug, Clone, Copy)]
pub(super) struct EchoShape {
    /// The echoed prompt's tokens go in `logprobs` (`echo` with `logprobs`).
    logprobs: bool,
    /// vLLM's `prompt_logprobs` was asked.
    prompt_logprobs: Option<usize>,
}

/// How completion answers are shaped.
pub(super) struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    echo: EchoShape,
}

impl CompletionFormat {
    /// A fresh response id, created now, for `model`.
    fn new(model: String, echo: EchoShape) -> Self {
        Self {
            id: response_id("cmpl"),
            created: unix_now(),
            model,
            echo,
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

    /// The choice's prompt part: its echoed text, its logprob columns (when reported)
    /// and vLLM's `prompt_logprobs`.
    fn prompt_part(&self, prompt: &PromptEcho, choice: &mut CompletionChoice) {
        if let Some(text) = &prompt.text {
            choice.text.insert_str(0, text);
        }
        if self.echo.logprobs {
            let mut columns = CompletionLogprobs::default();
            prompt_columns(&mut columns, prompt);
            if let Some(generated) = choice.logprobs.take() {
                columns.tokens.extend(generated.tokens);
                columns.token_logprobs.extend(generated.token_logprobs);
                columns.top_logprobs.extend(generated.top_logprobs);
                columns.text_offset.extend(generated.text_offset);
            }
            choice.logprobs = Some(columns);
        }
        if self.echo.prompt_logprobs.is_some() {
            choice
                .extra
                .insert("prompt_logprobs".into(), vllm_prompt_logprobs(prompt));
        }
    }
}

impl ResponseFormat for CompletionFormat {
    fn start_chunk(&self, _index: u32) -> Option<Bytes> {
        None
    }

    fn prompt_chunk(&self, index: u32, prompt: &PromptEcho) -> Option<Bytes> {
        let mut choice = Self::choice(index, String::new(), None, None);
        self.prompt_part(prompt, &mut choice);
        Some(sse::data_event(&self.body(vec![choice], None, None)))
    }

    fn text_chunk(&self, index: u32, text: String, logprob: Option<ResolvedLogprob>) -> Bytes {
        let logprobs = logprob.map(|lp| {
            let mut out = CompletionLogprobs::default();
            completion_logprobs(&mut out, vec![lp]);
            out
        });
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
                let logprobs = c.logprobs.map(|lps| {
                    let mut out = CompletionLogprobs::default();
                    completion_logprobs(&mut out, lps);
                    out
                });
                let mut choice = Self::choice(index, c.text, logprobs, Some(c.finish_reason));
                if let Some(prompt) = &c.prompt {
                    self.prompt_part(prompt, &mut choice);
                }
                if let Some(ids) = c.token_ids {
                    choice.extra.insert("token_ids".into(), ids.into());
                }
                choice
            })
            .collect();
        Json(self.body(choices, Some(usage), kv_transfer_params)).into_response()
    }
}
