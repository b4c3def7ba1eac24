//! A checked, tokenized request and how to answer it: what chat and completions share
//! once their own fields are validated, whether this worker serves the request alone or,
//! as an orchestrator, has a prefill worker compute its prompt first.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use pdserve_protocol::{ApiError, KvTransferParams};
use serde_json::{Map, Value};

use super::choices::{collect_response, stream_response, Submitted};
use super::response_format::{Generation, ResponseFormat};
use super::validate::OutputOptions;
use super::AppState;
use crate::handoff::Handoff;
use crate::orchestrator::OrchestratedRequest;
use crate::request::GenerationRequest;
use crate::serving::{EchoPlan, PromptScores};

/// One prompt of a request: what the scheduler runs, and what the answer reports of the
/// prompt itself (completions `echo`, prompt logprobs).
pub struct PromptRun {
    /// Prompt token ids, sampling, limits.
    pub request: GenerationRequest,
    /// How the prompt is echoed or scored; `None` for neither.
    pub echo: Option<EchoPlan>,
}

impl PromptRun {
    /// A prompt run as it is, reporting nothing of the prompt.
    pub fn plain(request: GenerationRequest) -> Self {
        Self {
            request,
            echo: None,
        }
    }
}

/// A validated request with its prompt(s) as token ids, answered in the shape of `F`
/// (chat, completions or Responses).
pub struct Prepared<F> {
    /// Its prompts (one, or a completions batch), answered in order.
    pub prompts: Vec<PromptRun>,
    /// Stop strings, applied to the output text.
    pub stop: Vec<String>,
    /// The client's own `kv_transfer_params` (a proxy running the handoff itself).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// SGLang's `bootstrap_host`/`bootstrap_port`/`bootstrap_room` (a gateway running
    /// SGLang's handoff: the same body goes to the prefill and the decode worker), one
    /// entry per choice; empty without them.
    pub bootstrap: Vec<pdserve_protocol::BootstrapParams>,
    /// How many choices (`n`) to generate, each a sequence of its own.
    pub choices: usize,
    /// The client's `model` field.
    pub model: Option<String>,
    /// The request's session key (see [`session_key`]).
    pub session: Option<String>,
    /// Its `first_token_from_prefill` field (an orchestrating worker's choice per
    /// request).
    pub first_token_from_prefill: Option<bool>,
    /// How to answer.
    pub reply: Reply<F>,
}

/// How a prepared request is answered: its API's shape and the output options.
pub struct Reply<F> {
    format: F,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    /// List each choice's token ids (vLLM's `return_token_ids`).
    token_ids: bool,
}

impl<F: ResponseFormat> Reply<F> {
    /// An answer in `format`, streamed and with usage as `options` ask.
    pub(super) fn new(format: F, options: &OutputOptions, logprobs: bool) -> Self {
        Self {
            format,
            stream: options.stream,
            include_usage: options.include_usage,
            logprobs,
            token_ids: options.return_token_ids,
        }
    }

    /// The same answer, its stream ending with usage whatever the client asked (the
    /// Responses API's stream always ends with the completed response).
    pub(super) fn always_with_usage(mut self) -> Self {
        self.include_usage = true;
        self
    }

    /// Whether the answer is a server-sent event stream.
    pub fn is_stream(&self) -> bool {
        self.stream
    }

    /// Answers with `generation`'s output: a stream, or one JSON body once it is done.
    pub async fn respond(self, generation: Generation) -> Response {
        self.respond_choices(Submitted::each(vec![generation]))
            .await
    }

    /// Answers with the output of every choice.
    pub async fn respond_choices(self, generations: Submitted) -> Response {
        if self.stream {
            stream_response(generations, self.format, self.include_usage)
        } else {
            collect_response(generations, self.format, self.logprobs, self.token_ids).await
        }
    }
}

/// The session key of a request: its body's `conversation_id`, its `X-Session-Id`
/// header or its body's `user`, in that order (non-empty strings only; the order of
/// [`pdserve_protocol::session`], which the gateway shares).
pub fn session_key(headers: &HeaderMap, extra: &Map<String, Value>) -> Option<String> {
    let field = |name: &str| extra.get(name).and_then(Value::as_str);
    pdserve_protocol::session::session_key(
        field(pdserve_protocol::session::CONVERSATION_ID),
        pdserve_protocol::session::header_session(headers),
        field("user"),
    )
    .map(str::to_string)
}

/// Serves `prepared` with the handoff it asks for ([`Handoff::choose`]): through the
/// orchestrator (a prefill worker computes the prompt once, this worker decodes every
/// choice) when this worker orchestrates and the client did not run the handoff itself;
/// otherwise on this worker, importing or publishing KV as the client's fields say.
pub(super) async fn serve<F: ResponseFormat>(
    app: &Arc<AppState>,
    prepared: Prepared<F>,
) -> Response {
    let handoff = match Handoff::choose(
        &app.serving,
        app.bootstrap.role,
        app.orchestrator.as_ref(),
        prepared.kv_transfer_params.as_ref(),
        &prepared.bootstrap,
    ) {
        Ok(handoff) => handoff,
        Err(e) => return e.into_response(),
    };
    let Prepared {
        prompts,
        stop,
        model,
        choices,
        session,
        reply,
        first_token_from_prefill,
        ..
    } = prepared;
    if prompts.len() > 1 && !matches!(handoff, Handoff::Local | Handoff::Orchestrated(_)) {
        return ApiError::bad_request(
            "a batch of prompts cannot carry kv_transfer_params or bootstrap fields \
             (send one request per prompt)",
        )
        .with_param("prompt")
        .into_response();
    }
    // Every prompt is submitted before the answer starts; an error drops the ones
    // already submitted, which cancels them and frees their KV.
    let mut all = Submitted::empty();
    for PromptRun { mut request, echo } in prompts {
        let submitted = match handoff {
            Handoff::Orchestrated(orchestrator) => {
                let orchestrated = OrchestratedRequest {
                    request,
                    stop: stop.clone(),
                    model: model.clone(),
                    choices,
                    session: session.clone(),
                    prime: reply.is_stream(),
                    echo,
                    first_token_from_prefill,
                };
                orchestrator
                    .serve(&app.serving, orchestrated)
                    .await
                    .map_err(IntoResponse::into_response)
            }
            local => {
                // A worker loading the prompt's KV lists the prompt unscored (SGLang's
                // decode side does so too): whoever computed it has the scores.
                let echo = echo.map(|mut plan| {
                    if !local.computes_prompt() {
                        request.prompt_logprobs = None;
                        if plan.scores == PromptScores::Computed {
                            plan.scores = PromptScores::Unscored;
                        }
                    }
                    plan
                });
                local
                    .submit(
                        &app.serving,
                        &app.bootstrap,
                        request,
                        stop.clone(),
                        choices,
                        echo.as_ref(),
                    )
                    .await
                    .map_err(IntoResponse::into_response)
            }
        };
        match submitted {
            Ok(submitted) => all.append(submitted),
            Err(response) => return response,
        }
    }
    reply.respond_choices(all).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_body_session_key_is_conversation_id_then_user() {
        let extra = |v: Value| v.as_object().unwrap().clone();
        let key = |v| session_key(&HeaderMap::new(), &extra(v));
        assert_eq!(
            key(json!({"conversation_id": "c", "user": "u"})).as_deref(),
            Some("c")
        );
        assert_eq!(
            key(json!({"conversation_id": "", "user": "u"})).as_deref(),
            Some("u")
        );
        assert_eq!(key(json!({"user": 7})), None);
        assert_eq!(key(json!({})), None);
    }

    #[test]
    fn the_session_header_comes_after_conversation_id_and_before_user() {
        let extra = |v: Value| v.as_object().unwrap().clone();
        let mut headers = HeaderMap::new();
        headers.insert("x-session-id", "h".parse().unwrap());
        let key = |v| session_key(&headers, &extra(v));
        assert_eq!(
            key(json!({"conversation_id": "c", "user": "u"})).as_deref(),
            Some("c")
        );
        assert_eq!(key(json!({"user": "u"})).as_deref(), Some("h"));
        assert_eq!(key(json!({})).as_deref(), Some("h"));
    }
}
