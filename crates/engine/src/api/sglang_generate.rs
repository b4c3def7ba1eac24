//! SGLang's native `POST /generate`: `text` or `input_ids` (one input or a batch),
//! `sampling_params` (one for all or one per input), `stream`, `return_logprob`,
//! `top_logprobs_num`, `rid`, and the bootstrap fields (one per input in a batch).
//!
//! Answers as SGLang does: `{"text", "meta_info": {"id", "finish_reason", "prompt_tokens",
//! "completion_tokens", "cached_tokens", "e2e_latency", ...}}` per output (a list for a
//! batch or for `sampling_params.n` > 1); a stream sends `data: {...}` events whose
//! `text` is the output so far (with `index` when the answer is a list), then
//! `data: [DONE]`.
//!
//! `n` > 1 (SGLang's `parallel_sample_num`, the same in every `sampling_params`): each
//! input has `n` outputs, listed input by input (output `i * n + s` is input `i`'s
//! sample `s`), each a sequence of its own with a fresh `rid`; sample 0 runs first so the
//! others take its prompt blocks from the prefix cache. Each sample has its own
//! bootstrap room: as SGLang normalises the fields, one room `r` stands for `r + k` and a
//! list of `inputs * n` is indexed by `k`, where `k = i + s * inputs`; a list of one room
//! per input gives input `i`'s samples `room[i] + s`. Rooms used twice are refused.

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use pdserve_protocol::{
    sse, ApiError, BootstrapParams, GenerationParams, OneOrMany, StopSequences, Usage,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::body::{parse_json, sse_response};
use super::response_format::{Generation, Piece, ResolvedLogprob};
use super::sglang_generate_rooms::sample_rooms;
use super::validate::{choice_count, generation_request, top_logprobs, MAX_STOP_STRINGS};
use super::AppState;
use crate::handoff::Handoff;
use crate::request::GenerationRequest;

/// SGLang's `max_new_tokens` when a request gives none.
const DEFAULT_MAX_NEW_TOKENS: i64 = 128;

/// `POST /generate` body.
#[derive(Debug, Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    text: Option<OneOrMany<String>>,
    #[serde(default)]
    input_ids: Option<OneOrMany<Vec<u32>>>,
    #[serde(default)]
    sampling_params: Option<OneOrMany<SglSamplingParams>>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    return_logprob: Option<OneOrMany<bool>>,
    #[serde(default)]
    logprob_start_len: Option<OneOrMany<i64>>,
    #[serde(default)]
    top_logprobs_num: Option<OneOrMany<i64>>,
    #[serde(default)]
    return_text_in_logprobs: bool,
    #[serde(default)]
    rid: Option<OneOrMany<String>>,
    #[serde(default)]
    bootstrap_host: Option<OneOrMany<String>>,
    #[serde(default)]
    bootstrap_port: Option<OneOrMany<Option<u16>>>,
    #[serde(default)]
    bootstrap_room: Option<OneOrMany<u64>>,
    /// Other fields: refused unless null or in [`IGNORED_FIELDS`] (SGLang itself refuses
    /// fields it does not know; `image_data`, `lora_path`, ... would change the answer).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// Top-level `/generate` fields accepted and not used: they only steer SGLang's own
/// logging and data-parallel placement, never the answer.
const IGNORED_FIELDS: &[&str] = &["log_metrics", "modalities", "data_parallel_rank"];

/// A 400 naming the first field this worker would otherwise silently ignore.
fn refuse_unimplemented(rest: &Map<String, Value>) -> Result<(), ApiError> {
    match rest
        .iter()
        .find(|(key, value)| !value.is_null() && !IGNORED_FIELDS.contains(&key.as_str()))
    {
        Some((key, _)) => Err(ApiError::bad_request(format!(
            "`{key}` is not supported by this worker's /generate"
        ))
        .with_param(key.as_str())),
        None => Ok(()),
    }
}

/// SGLang's `sampling_params`; unknown keys are refused, as SGLang does.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SglSamplingParams {
    max_new_tokens: Option<i64>,
    min_new_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    stop: Option<StopSequences>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    n: Option<i64>,
    sampling_seed: Option<i64>,
    logit_bias: Option<BTreeMap<String, f64>>,
    // Output formatting SGLang applies when detokenizing; accepted, not used.
    #[serde(rename = "skip_special_tokens")]
    _skip_special_tokens: Option<bool>,
    #[serde(rename = "spaces_between_special_tokens")]
    _spaces_between_special_tokens: Option<bool>,
    #[serde(rename = "no_stop_trim")]
    _no_stop_trim: Option<bool>,
}

/// One input of a request, checked and tokenized.
struct Item {
    request: GenerationRequest,
    stop: Vec<String>,
    /// One per sample; empty without bootstrap fields.
    bootstrap: Vec<BootstrapParams>,
    rid: String,
    logprobs: bool,
}

/// How many inputs `req` has, and whether it is a batch (answered with a list).
fn inputs(req: &GenerateRequest) -> Result<(usize, bool), ApiError> {
    match (&req.text, &req.input_ids) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "Either text or input_ids should be provided, not both",
        )
        .with_param("text")),
        (None, None) => Err(
            ApiError::bad_request("Either text or input_ids should be provided").with_param("text"),
        ),
        (Some(OneOrMany::One(_)), _) | (_, Some(OneOrMany::One(_))) => Ok((1, false)),
        (Some(OneOrMany::Many(v)), _) => Ok((v.len(), true)),
        (_, Some(OneOrMany::Many(v))) => Ok((v.len(), true)),
    }
}

/// The value of `field` for input `i` of `n`.
fn pick<T: Clone>(
    value: &Option<OneOrMany<T>>,
    i: usize,
    n: usize,
    field: &str,
) -> Result<Option<T>, ApiError> {
    match value {
        None => Ok(None),
        Some(OneOrMany::One(v)) => Ok(Some(v.clone())),
        Some(OneOrMany::Many(list)) if list.len() == n => Ok(Some(list[i].clone())),
        Some(OneOrMany::Many(list)) => Err(ApiError::bad_request(format!(
            "{field} has {} entries for {n} inputs",
            list.len()
        ))
        .with_param(field)),
    }
}

/// SGLang's `parallel_sample_num`: `sampling_params.n` (1 when absent), equal across a
/// list of sampling params.
fn samples(req: &GenerateRequest) -> Result<usize, ApiError> {
    let n = match &req.sampling_params {
        None => None,
        Some(OneOrMany::One(sp)) => sp.n,
        Some(OneOrMany::Many(list)) => {
            let first = list.first().and_then(|sp| sp.n);
            if list
                .iter()
                .any(|sp| sp.n.unwrap_or(1) != first.unwrap_or(1))
            {
                return Err(ApiError::bad_request(
                    "sampling_params.n must be the same for every input",
                )
                .with_param("n"));
            }
            first
        }
    };
    choice_count(n)
}

/// Handles one `/generate` request.
pub async fn handle(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: GenerateRequest = parse_json(body)?;
    refuse_unimplemented(&req.rest)?;
    let (n, batch) = inputs(&req)?;
    if n == 0 {
        return Err(ApiError::bad_request("the batch is empty").with_param("text"));
    }
    let samples = samples(&req)?;
    let mut items = Vec::with_capacity(n);
    let mut rooms = HashSet::new();
    for i in 0..n {
        let item = prepare(&app, &req, i, n, samples).await?;
        if let Some(dup) = item
            .bootstrap
            .iter()
            .find(|f| !rooms.insert(f.bootstrap_room))
        {
            return Err(ApiError::bad_request(format!(
                "bootstrap_room {} is used by two outputs",
                dup.bootstrap_room
            ))
            .with_param("bootstrap_room"));
        }
        items.push(item);
    }
    let text_in_logprobs = req.return_text_in_logprobs;
    let submitted = items.into_iter().map(|item| {
        let app = app.clone();
        async move {
            // SGLang's native route: bootstrap rooms or nothing; never orchestrated.
            let handoff = Handoff::choose(
                &app.serving,
                app.bootstrap.role,
                None,
                None,
                &item.bootstrap,
            )?;
            let submitted = handoff
                .submit(
                    &app.serving,
                    &app.bootstrap,
                    item.request,
                    item.stop,
                    samples,
                    None,
                )
                .await?;
            let one = submitted.generations.len() == 1;
            Ok::<_, ApiError>(
                submitted
                    .generations
                    .into_iter()
                    .map(|generation| Output {
                        generation,
                        // SGLang gives every sample a fresh rid.
                        rid: if one {
                            item.rid.clone()
                        } else {
                            uuid::Uuid::new_v4().simple().to_string()
                        },
                        logprobs: item.logprobs,
                        text_in_logprobs,
                    })
                    .collect::<Vec<_>>(),
            )
        }
    });
    // Concurrently: a batch's rooms meet their decode reads at the same time.
    let outputs: Vec<Output> = futures::future::try_join_all(submitted)
        .await?
        .into_iter()
        .flatten()
        .collect();
    let listed = batch || samples > 1;
    if req.stream {
        return Ok(stream(outputs, listed, started));
    }
    let answers = futures::future::join_all(outputs.into_iter().map(|o| o.collect(started))).await;
    let mut bodies = Vec::with_capacity(answers.len());
    for answer in answers {
        bodies.push(answer?);
    }
    Ok(if listed {
        Json(Value::Array(bodies)).into_response()
    } else {
        Json(bodies.remove(0)).into_response()
    })
}

/// Checks and tokenizes input `i` of `n` (`samples` outputs each).
async fn prepare(
    app: &Arc<AppState>,
    req: &GenerateRequest,
    i: usize,
    n: usize,
    samples: usize,
) -> Result<Item, ApiError> {
    let (prompt, prompt_param) = match (&req.text, &req.input_ids) {
        (Some(text), _) => {
            let text = pick(&Some(text.clone()), i, n, "text")?.unwrap_or_default();
            (tokenize(app, text).await?, "text")
        }
        (_, Some(ids)) => (
            pick(&Some(ids.clone()), i, n, "input_ids")?.unwrap_or_default(),
            "input_ids",
        ),
        (None, None) => unreachable!("checked by inputs()"),
    };
    let sp = pick(&req.sampling_params, i, n, "sampling_params")?.unwrap_or_default();
    let logprobs = pick(&req.return_logprob, i, n, "return_logprob")?.unwrap_or(false);
    if let Some(start) = pick(&req.logprob_start_len, i, n, "logprob_start_len")? {
        if logprobs && start >= 0 {
            return Err(ApiError::bad_request(
                "input token logprobs (logprob_start_len >= 0) are not supported by this worker",
            )
            .with_param("logprob_start_len"));
        }
    }
    let top = match pick(&req.top_logprobs_num, i, n, "top_logprobs_num")? {
        Some(k) => top_logprobs("top_logprobs_num", k)?,
        None => 0,
    };
    let stop = sp
        .stop
        .as_ref()
        .map(StopSequences::to_vec)
        .unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
            stop.len()
        ))
        .with_param("stop"));
    }
    // SGLang's default of 128 new tokens, shortened to what the context has room for.
    let room = app
        .serving
        .limits
        .max_model_len
        .saturating_sub(prompt.len())
        .max(1) as i64;
    let max_new = sp
        .max_new_tokens
        .unwrap_or(DEFAULT_MAX_NEW_TOKENS.min(room));
    // Through JSON, by the OpenAI field names: SGLang's sampling parameters are named as
    // vLLM's apart from these, so the checks are the chat and completions ones.
    let params: GenerationParams = serde_json::from_value(json!({
        "max_tokens": max_new,
        "min_tokens": sp.min_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "seed": sp.sampling_seed,
        "n": sp.n,
        "ignore_eos": sp.ignore_eos,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "min_p": sp.min_p,
        "logit_bias": sp.logit_bias,
    }))
    .map_err(|e| ApiError::bad_request(format!("sampling_params: {e}")))?;
    let mut request = generation_request(
        prompt,
        &params,
        params.max_tokens,
        logprobs.then_some(top),
        &app.serving.limits,
        prompt_param,
    )?;
    if let Some(ids) = &sp.stop_token_ids {
        if let Some(&bad) = ids
            .iter()
            .find(|&&t| t as usize >= app.serving.limits.vocab_size)
        {
            return Err(ApiError::bad_request(format!(
                "stop_token_ids: token id {bad} is out of range"
            ))
            .with_param("stop_token_ids"));
        }
        request.stop_token_ids.extend(ids);
    }
    let bootstrap = sample_rooms(
        &req.bootstrap_host,
        &req.bootstrap_port,
        &req.bootstrap_room,
        i,
        n,
        samples,
    )?;
    let rid =
        pick(&req.rid, i, n, "rid")?.unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    Ok(Item {
        request,
        stop,
        bootstrap,
        rid,
        logprobs,
    })
}

async fn tokenize(app: &Arc<AppState>, text: String) -> Result<Vec<u32>, ApiError> {
    let model = app.serving.text.clone();
    let ids = tokio::task::spawn_blocking(move || model.tokenizer().encode(&text, true))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the text: {e}")))?;
    app.serving.metrics.prompts_tokenized.inc();
    Ok(ids)
}

/// One input's output and how to report it.
struct Output {
    generation: Generation,
    rid: String,
    logprobs: bool,
    text_in_logprobs: bool,
}

/// What an output has produced so far.
#[derive(Default)]
struct Progress {
    text: String,
    logprobs: Vec<ResolvedLogprob>,
    completion_tokens: usize,
}

impl Output {
    /// Runs to the end and answers one input's JSON object.
    async fn collect(mut self, started: Instant) -> Result<Value, ApiError> {
        let mut progress = Progress::default();
        loop {
            match self.generation.next().await {
                Some(Piece::Token { text, logprob, .. }) => {
                    progress.completion_tokens += 1;
                    progress.text.push_str(&text);
                    progress.logprobs.extend(logprob);
                }
                Some(Piece::Tail(text)) => progress.text.push_str(&text),
                // `/generate` never asks for the prompt part.
                Some(Piece::Prompt(_)) => {}
                Some(Piece::End {
                    finish_reason,
                    usage,
                    ..
                }) => return Ok(self.body(&progress, Some((finish_reason, &usage)), started)),
                Some(Piece::Error(e)) => return Err(e),
                None => return Err(ApiError::internal("the request ended without a result")),
            }
        }
    }

    /// An SGLang output object: the text so far and its `meta_info`.
    fn body(&self, p: &Progress, end: Option<(&str, &Usage)>, started: Instant) -> Value {
        let mut meta = Map::new();
        meta.insert("id".into(), json!(self.rid));
        let finish = end.map(|(reason, usage)| match reason {
            "length" => json!({"type": "length", "length": usage.completion_tokens}),
            _ => json!({"type": "stop", "matched": null}),
        });
        meta.insert("finish_reason".into(), finish.unwrap_or(Value::Null));
        let (prompt, completion, cached) = match end {
            Some((_, u)) => (
                u.prompt_tokens,
                u.completion_tokens,
                u.prompt_tokens_details
                    .as_ref()
                    .map_or(0, |d| d.cached_tokens),
            ),
            None => (
                self.generation.prompt_tokens() as u64,
                p.completion_tokens as u64,
                0,
            ),
        };
        meta.insert("prompt_tokens".into(), json!(prompt));
        meta.insert("completion_tokens".into(), json!(completion));
        meta.insert("cached_tokens".into(), json!(cached));
        meta.insert("e2e_latency".into(), json!(started.elapsed().as_secs_f64()));
        if self.logprobs {
            let text = |bytes: &[u8]| {
                self.text_in_logprobs
                    .then(|| String::from_utf8_lossy(bytes).into_owned())
            };
            let tokens: Vec<Value> = p
                .logprobs
                .iter()
                .map(|lp| json!([lp.logprob, lp.id, text(&lp.bytes)]))
                .collect();
            let tops: Vec<Value> = p
                .logprobs
                .iter()
                .map(|lp| {
                    Value::Array(
                        lp.top
                            .iter()
                            .zip(&lp.top_ids)
                            .map(|((bytes, l), id)| json!([l, id, text(bytes)]))
                            .collect(),
                    )
                })
                .collect();
            meta.insert("output_token_logprobs".into(), Value::Array(tokens));
            meta.insert("output_top_logprobs".into(), Value::Array(tops));
        }
        json!({"text": p.text, "meta_info": meta})
    }
}

/// Streams every output's events (tagged with `index` when the answer is a list), then
/// `[DONE]`.
fn stream(outputs: Vec<Output>, batch: bool, started: Instant) -> Response {
    let streams = outputs.into_iter().enumerate().map(|(index, output)| {
        let state = Some((output, Progress::default()));
        futures::stream::unfold(state, move |state| async move {
            let (mut output, mut p) = state?;
            let tag = |mut v: Value| {
                if batch {
                    v["index"] = json!(index);
                }
                sse::data_event(&v)
            };
            loop {
                let event = match output.generation.next().await? {
                    Piece::Token { text, logprob, .. } => {
                        p.completion_tokens += 1;
                        let silent = text.is_empty() && logprob.is_none();
                        p.text.push_str(&text);
                        p.logprobs.extend(logprob);
                        if silent {
                            continue;
                        }
                        tag(output.body(&p, None, started))
                    }
                    Piece::Tail(text) => {
                        p.text.push_str(&text);
                        tag(output.body(&p, None, started))
                    }
                    Piece::Prompt(_) => continue,
                    Piece::End {
                        finish_reason,
                        usage,
                        ..
                    } => {
                        let event = tag(output.body(&p, Some((finish_reason, &usage)), started));
                        return Some((event, None));
                    }
                    Piece::Error(e) => {
                        tracing::warn!("/generate stream ended by an error: {e}");
                        return Some((tag(e.to_json()), None));
                    }
                };
                return Some((event, Some((output, p))));
            }
        })
        .boxed()
    });
    let events = futures::stream::select_all(streams)
        .chain(futures::stream::once(async {
            Bytes::from_static(sse::DONE)
        }))
        .map(Ok::<_, Infallible>);
    sse_response(events)
}
