//! `POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE
//! /v1/responses/{id}`: `input` (a string or message items) after `instructions` and the
//! conversation of `previous_response_id`, rendered with the chat template; the answer
//! is one `message` output item, or a stream of the Responses events; stored (unless
//! `store: false`) for retrieval and for the next turn. The previous turn's blocks are
//! in the prefix cache, so a next turn computes only what is new.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::HeaderMap;
use pdserve_model::ChatTurn;
use pdserve_protocol::responses::{ItemContent, ResponseInput, ResponsesRequest};
use pdserve_protocol::{unix_now, ApiError, KvTransferParams, Usage};
use serde_json::{json, Value};

use super::body::parse_json;
use super::prepared::{serve, session_key, Prepared, PromptRun, Reply};
use super::response_format::{ChoiceOutput, ResolvedLogprob, ResponseFormat};
use super::response_store::{ResponseStore, StoredResponse};
use super::unsupported::check_unsupported;
use super::validate::{check_model, generation_request, output_options, request_priority};
use super::AppState;

/// Handles `POST /v1/responses`.
pub async fn create(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_json(body)?;
    let prepared = prepare(&app, req, &headers).await?;
    Ok(serve(&app, prepared).await)
}

/// Handles `GET /v1/responses/{id}`.
pub async fn retrieve(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match app.responses.get(&id) {
        Some(stored) => Ok(Json(stored.body)),
        None => Err(not_found(&id, "response_id")),
    }
}

/// Handles `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if app.responses.remove(&id) {
        Ok(Json(
            json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(not_found(&id, "response_id"))
    }
}

fn not_found(id: &str, param: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found.")).with_param(param)
}

/// Responses fields this worker does not implement, refused with a 400 naming them.
fn check_responses_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    let refuse = |param: &str, what: &str| {
        Err(
            ApiError::bad_request(format!("{what} is not supported by this worker"))
                .with_param(param),
        )
    };
    let extra = &req.extra;
    if let Some(text) = extra.get("text").filter(|v| !v.is_null()) {
        let kind = text.get("format").and_then(|f| f.get("type"));
        if kind.is_some_and(|k| k != "text") {
            return refuse("text.format", "text.format other than {\"type\": \"text\"}");
        }
    }
    if extra.get("reasoning").is_some_and(|v| !v.is_null()) {
        return refuse("reasoning", "reasoning");
    }
    if extra.get("background").and_then(Value::as_bool) == Some(true) {
        return refuse("background", "background mode");
    }
    if extra.get("conversation").is_some_and(|v| !v.is_null()) {
        return refuse(
            "conversation",
            "conversation objects (use previous_response_id)",
        );
    }
    if let Some(choice) = extra.get("tool_choice").filter(|v| !v.is_null()) {
        if choice != "none" && choice != "auto" {
            return refuse("tool_choice", "tool calling");
        }
    }
    if req.generation.n.is_some_and(|n| n != 1) {
        return refuse("n", "n other than 1");
    }
    check_unsupported(extra)
}

/// The input items as template turns; `developer` counts as `system`.
fn input_turns(input: &ResponseInput) -> Result<Vec<ChatTurn>, ApiError> {
    let bad = |msg: String| Err(ApiError::bad_request(msg).with_param("input"));
    let items = match input {
        ResponseInput::Text(text) => {
            return Ok(vec![ChatTurn {
                role: "user".into(),
                content: text.clone(),
            }])
        }
        ResponseInput::Items(items) => items,
    };
    if items.is_empty() {
        return bad("input must not be empty".into());
    }
    let mut turns = Vec::with_capacity(items.len());
    for item in items {
        if item.kind.as_deref().is_some_and(|k| k != "message") {
            return bad(format!(
                "input items of type {:?} are not supported (only messages)",
                item.kind.as_deref().unwrap_or_default()
            ));
        }
        let role = match item.role.as_deref() {
            Some("developer") => "system",
            Some(role @ ("user" | "system" | "assistant")) => role,
            other => return bad(format!("unknown message role {other:?}")),
        };
        let content = match &item.content {
            None => String::new(),
            Some(ItemContent::Text(text)) => text.clone(),
            Some(ItemContent::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return bad(format!(
                                "this model accepts only text content parts, got {kind:?}"
                            ))
                        }
                    }
                }
                text
            }
        };
        turns.push(ChatTurn {
            role: role.into(),
            content,
        });
    }
    Ok(turns)
}

/// Checks `req`, builds its conversation and tokenizes it.
async fn prepare(
    app: &Arc<AppState>,
    req: ResponsesRequest,
    headers: &HeaderMap,
) -> Result<Prepared<ResponsesFormat>, ApiError> {
    check_model(req.model.as_deref(), &app.serving.limits)?;
    check_responses_unsupported(&req)?;
    let options = output_options(&req.transport, &req.generation)?;
    let (mut conversation, root) = match &req.previous_response_id {
        None => (Vec::new(), None),
        Some(id) => {
            let stored = app.responses.get(id).ok_or_else(|| {
                ApiError::not_found(format!("Previous response with id '{id}' not found."))
                    .with_param("previous_response_id")
            })?;
            (stored.turns, Some(stored.root))
        }
    };
    conversation.extend(input_turns(&req.input)?);
    let mut turns = Vec::with_capacity(conversation.len() + 1);
    if let Some(instructions) = &req.instructions {
        turns.push(ChatTurn {
            role: "system".into(),
            content: instructions.clone(),
        });
    }
    turns.extend(conversation.iter().cloned());
    let prompt = super::chat::chat_prompt(app, turns).await?;
    let mut request = generation_request(
        prompt,
        &req.generation,
        req.max_output_tokens,
        None,
        &app.serving.limits,
        "input",
    )
    .map_err(|e| match e.body.error.param.as_deref() {
        Some("max_tokens") => e.with_param("max_output_tokens"),
        _ => e,
    })?;
    request.priority = request_priority(&req.extra)?;
    let store = req
        .store
        .unwrap_or(true)
        .then(|| (app.responses.clone(), conversation));
    let format = ResponsesFormat::new(
        app.serving.limits.served_model_name.clone(),
        &req,
        store,
        root,
    );
    // A chain is one session: its first response's id names it.
    let session = session_key(headers, &req.extra).or_else(|| Some(format.root.clone()));
    Ok(Prepared {
        prompts: vec![PromptRun::plain(request)],
        session,
        first_token_from_prefill: None,
        bootstrap: crate::bootstrap::fields(&req.transport, 1)?,
        choices: 1,
        kv_transfer_params: req.transport.kv_transfer_params,
        model: req.model,
        reply: Reply::new(format, &options, false).always_with_usage(),
        stop: options.stop,
    })
}

/// What a stream has said so far.
#[derive(Default)]
struct Progress {
    text: String,
    sequence_number: u64,
    finish_reason: Option<&'static str>,
    kv_transfer_params: Option<KvTransferParams>,
}

/// How Responses answers are shaped, and where they are stored.
pub(super) struct ResponsesFormat {
    id: String,
    /// The chain's first response id (this one's, on a first turn).
    root: String,
    message_id: String,
    created_at: u64,
    model: String,
    /// The request's fields the response object repeats.
    settings: Value,
    /// The store and the conversation so far, unless `store: false`.
    store: Option<(Arc<ResponseStore>, Vec<ChatTurn>)>,
    progress: Mutex<Progress>,
}

impl ResponsesFormat {
    fn new(
        model: String,
        req: &ResponsesRequest,
        store: Option<(Arc<ResponseStore>, Vec<ChatTurn>)>,
        root: Option<String>,
    ) -> Self {
        let hex = || uuid::Uuid::new_v4().simple().to_string();
        let id = format!("resp_{}", hex());
        crate::trace::note_response_id(&id);
        let settings = json!({
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.generation.temperature,
            "top_p": req.generation.top_p,
            "previous_response_id": req.previous_response_id,
            "store": store.is_some(),
            "metadata": req.extra.get("metadata").cloned().unwrap_or(json!({})),
            "parallel_tool_calls": false,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
        });
        Self {
            root: root.unwrap_or_else(|| id.clone()),
            id,
            message_id: format!("msg_{}", hex()),
            created_at: unix_now(),
            model,
            settings,
            store,
            progress: Mutex::default(),
        }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The output message item: in progress (`finish_reason` none yet), or done.
    fn message(&self, text: &str, finish_reason: Option<&str>) -> Value {
        let content = if finish_reason.is_some() {
            json!([{"type": "output_text", "text": text, "annotations": []}])
        } else {
            json!([])
        };
        let status = match finish_reason {
            None => "in_progress",
            Some("length") => "incomplete",
            Some(_) => "completed",
        };
        json!({
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }

    /// The response object: in progress (no output yet), or finished with `text`.
    fn object(
        &self,
        finished: Option<(&str, &'static str, &Usage)>,
        kv_transfer_params: Option<&KvTransferParams>,
    ) -> Value {
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "in_progress",
            "incomplete_details": null,
            "error": null,
            "output": [],
            "usage": null,
        });
        if let Some((text, finish_reason, usage)) = finished {
            let incomplete = finish_reason == "length";
            object["status"] = json!(if incomplete {
                "incomplete"
            } else {
                "completed"
            });
            if incomplete {
                object["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            object["output"] = json!([self.message(text, Some(finish_reason))]);
            object["usage"] = responses_usage(usage);
        }
        if let (Some(map), Some(settings)) = (object.as_object_mut(), self.settings.as_object()) {
            map.extend(settings.clone());
        }
        if let Some(params) = kv_transfer_params {
            object["kv_transfer_params"] = json!(params);
        }
        object
    }

    /// Keeps the finished response and its conversation (with `store`).
    fn keep(&self, object: &Value, text: &str) {
        let Some((store, conversation)) = &self.store else {
            return;
        };
        let mut turns = conversation.clone();
        turns.push(ChatTurn {
            role: "assistant".into(),
            content: text.to_string(),
        });
        let mut body = object.clone();
        if let Some(map) = body.as_object_mut() {
            map.remove("kv_transfer_params");
        }
        let root = self.root.clone();
        store.put(self.id.clone(), StoredResponse { body, turns, root });
    }

    /// One streaming event: `event:` its type, `data:` the object with `type` and
    /// `sequence_number`.
    fn event(&self, progress: &mut Progress, kind: &str, mut data: Value) -> Vec<u8> {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(progress.sequence_number);
        progress.sequence_number += 1;
        format!("event: {kind}\ndata: {data}\n\n").into_bytes()
    }
}

/// OpenAI's Responses usage from the engine's.
fn responses_usage(usage: &Usage) -> Value {
    let cached = usage
        .prompt_tokens_details
        .as_ref()
        .map_or(0, |d| d.cached_tokens);
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    })
}

impl ResponseFormat for ResponsesFormat {
    fn start_chunk(&self, _index: u32) -> Option<Bytes> {
        let mut p = self.progress();
        let mut out = Vec::new();
        let object = self.object(None, None);
        out.extend(self.event(&mut p, "response.created", json!({"response": object})));
        out.extend(self.event(&mut p, "response.in_progress", json!({"response": object})));
        let item = self.message("", None);
        out.extend(self.event(
            &mut p,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        ));
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        out.extend(self.event(
            &mut p,
            "response.content_part.added",
            json!({"item_id": self.message_id, "output_index": 0, "content_index": 0, "part": part}),
        ));
        Some(Bytes::from(out))
    }

    fn text_chunk(&self, _index: u32, text: String, _logprob: Option<ResolvedLogprob>) -> Bytes {
        let mut p = self.progress();
        if text.is_empty() {
            return Bytes::new();
        }
        p.text.push_str(&text);
        let data = json!({"item_id": self.message_id, "output_index": 0, "content_index": 0,
                          "delta": text, "logprobs": []});
        Bytes::from(self.event(&mut p, "response.output_text.delta", data))
    }

    fn finish_chunk(
        &self,
        _index: u32,
        finish_reason: &'static str,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Bytes {
        let mut p = self.progress();
        p.finish_reason = Some(finish_reason);
        p.kv_transfer_params = kv_transfer_params;
        let text = p.text.clone();
        let mut out = Vec::new();
        let at = json!({"item_id": self.message_id, "output_index": 0, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(text);
        done["logprobs"] = json!([]);
        out.extend(self.event(&mut p, "response.output_text.done", done));
        let mut part = at;
        part["part"] = json!({"type": "output_text", "text": text, "annotations": []});
        out.extend(self.event(&mut p, "response.content_part.done", part));
        out.extend(self.event(
            &mut p,
            "response.output_item.done",
            json!({"output_index": 0, "item": self.message(&text, Some(finish_reason))}),
        ));
        Bytes::from(out)
    }

    fn usage_chunk(&self, usage: Usage) -> Bytes {
        let mut p = self.progress();
        let finish = p.finish_reason.unwrap_or("stop");
        let text = p.text.clone();
        let object = self.object(Some((&text, finish, &usage)), p.kv_transfer_params.as_ref());
        self.keep(&object, &text);
        let kind = if finish == "length" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        Bytes::from(self.event(&mut p, kind, json!({"response": object})))
    }

    fn end_chunk(&self) -> &'static [u8] {
        // The Responses stream ends with its response.completed event.
        b""
    }

    fn error_chunk(&self, error: &ApiError) -> Bytes {
        let mut p = self.progress();
        let detail = &error.body.error;
        let data = json!({
            "code": detail.code.clone().unwrap_or_else(|| json!(detail.kind)),
            "message": detail.message,
            "param": detail.param,
        });
        Bytes::from(self.event(&mut p, "error", data))
    }

    fn response(
        &self,
        choices: Vec<ChoiceOutput>,
        usage: Usage,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> Response {
        let (text, finish) = choices
            .into_iter()
            .next()
            .map_or((String::new(), "stop"), |c| (c.text, c.finish_reason));
        let object = self.object(Some((&text, finish, &usage)), kv_transfer_params.as_ref());
        self.keep(&object, &text);
        Json(object).into_response()
    }
}
