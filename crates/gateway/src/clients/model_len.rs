//! The model's context length (`max_model_len` of the workers' `GET /v1/models`, as
//! vLLM and pdserve workers report it), cached per worker, and the check of a request's
//! length against it before the prefill leg.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdserve_protocol::{ApiError, ModelList, Prompt};

use crate::clients::worker_client::{Exchange, ForwardHeaders, WorkerClient};
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;

/// `max_model_len` per worker base URL (`None` while a fetch is under way or when the
/// worker reports none).
#[derive(Debug, Default)]
pub struct ModelLens {
    known: Arc<Mutex<HashMap<String, Option<u64>>>>,
    /// The model ids each worker serves, once its list was read.
    names: Arc<Mutex<HashMap<String, Vec<String>>>>,
}

impl ModelLens {
    /// The worker's context length, if fetched; the first call for a worker starts the
    /// fetch in the background (the request that triggered it is not held up).
    pub fn get(&self, client: &WorkerClient, worker: &Arc<Worker>) -> Option<u64> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(len) = known.get(&worker.base) {
            return *len;
        }
        known.insert(worker.base.clone(), None);
        drop(known);
        let (client, worker) = (client.clone(), worker.clone());
        let (known, names) = (self.known.clone(), self.names.clone());
        tokio::spawn(async move {
            let list = fetch(&client, &worker).await;
            let len = list.as_ref().and_then(|list| {
                names.lock().unwrap_or_else(|e| e.into_inner()).insert(
                    worker.base.clone(),
                    list.data.iter().map(|c| c.id.clone()).collect(),
                );
                list.data.iter().filter_map(|card| card.max_model_len).min()
            });
            let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
            match len {
                Some(len) => {
                    known.insert(worker.base.clone(), Some(len));
                }
                // Asked again on a later request.
                None => {
                    known.remove(&worker.base);
                }
            }
        });
        None
    }

    /// The smallest context length known of any worker.
    pub fn smallest(&self) -> Option<u64> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.values().flatten().copied().min()
    }

    /// The model ids `worker` serves, once its model list was read (see [`Self::get`]).
    pub fn names(&self, worker: &Worker) -> Option<Vec<String>> {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.get(&worker.base).cloned()
    }

    /// Records a worker's context length (tests, and workers whose length is known).
    pub fn set(&self, base: &str, len: u64) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.insert(base.to_string(), Some(len));
    }
}

/// The worker's model list (its smallest `max_model_len` is the context length).
async fn fetch(client: &WorkerClient, worker: &Worker) -> Option<ModelList> {
    let headers = ForwardHeaders::from_client(&http::HeaderMap::new());
    let exchange = Exchange::new(worker, "worker", Duration::from_secs(10));
    let request = client.get(worker.models_url(), &headers);
    let body = exchange.send_and_read(request).await.ok()?;
    serde_json::from_slice(&body).ok()
}

/// Rejects, in vLLM's words, a request whose `max_tokens` (plus its prompt, when given as
/// token ids or counted by the gateway's tokenizer as `known`; else at least one token)
/// cannot fit in `max_model_len`.
#[allow(clippy::result_large_err)]
pub fn check(
    request: &mut ClientRequest,
    max_model_len: u64,
    known: Option<u64>,
) -> Result<(), ApiError> {
    let (input, exact) = match request {
        _ if known.is_some() => (known.unwrap_or(1), true),
        ClientRequest::Completion(c) => match &c.prompt {
            Prompt::Tokens(ids) => (ids.len() as u64, true),
            Prompt::TokenBatches(batches) => (
                batches.iter().map(|b| b.len() as u64).max().unwrap_or(0),
                true,
            ),
            _ => (1, false),
        },
        ClientRequest::Chat(_) => (1, false),
    };
    let generation = request.generation_mut();
    let (field, asked) = match (generation.max_completion_tokens, generation.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", n),
        (None, Some(n)) => ("max_tokens", n),
        (None, None) => {
            if exact && input >= max_model_len {
                return Err(too_long_prompt(input, max_model_len));
            }
            return Ok(());
        }
    };
    let Ok(asked) = u64::try_from(asked) else {
        // Negative: the worker says what is wrong with it.
        return Ok(());
    };
    if exact && input >= max_model_len {
        return Err(too_long_prompt(input, max_model_len));
    }
    if asked.saturating_add(input) <= max_model_len {
        return Ok(());
    }
    let at_least = if exact { "" } else { "at least " };
    Err(ApiError::bad_request(format!(
        "'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum \
         context length is {max_model_len} tokens and your request has {at_least}{input} input \
         tokens ({asked} > {max_model_len} - {input})."
    ))
    .with_param(field))
}

fn too_long_prompt(input: u64, max_model_len: u64) -> ApiError {
    ApiError::bad_request(format!(
        "This model's maximum context length is {max_model_len} tokens. However, your request \
         has {input} input tokens. Please reduce the length of the input messages."
    ))
    .with_param("prompt")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;

    fn parse(endpoint: Endpoint, body: &str) -> ClientRequest {
        ClientRequest::parse(endpoint, body.as_bytes()).unwrap().0
    }

    #[test]
    fn rejects_what_cannot_fit_and_passes_the_rest() {
        let mut fits = parse(Endpoint::Chat, r#"{"messages":[],"max_tokens":2047}"#);
        assert!(check(&mut fits, 2048, None).is_ok());
        let mut open = parse(Endpoint::Chat, r#"{"messages":[]}"#);
        assert!(check(&mut open, 2048, None).is_ok());
        let mut too_many = parse(Endpoint::Chat, r#"{"messages":[],"max_tokens":2048}"#);
        let err = check(&mut too_many, 2048, None).unwrap_err();
        assert_eq!(err.status, http::StatusCode::BAD_REQUEST);
        assert_eq!(err.body.error.param.as_deref(), Some("max_tokens"));
        assert!(
            err.body
                .error
                .message
                .contains("maximum context length is 2048"),
            "{}",
            err.body.error.message
        );
        let mut ids = parse(
            Endpoint::Completions,
            r#"{"prompt":[1,2,3,4],"max_completion_tokens":5}"#,
        );
        let err = check(&mut ids, 8, None).unwrap_err();
        assert_eq!(
            err.body.error.param.as_deref(),
            Some("max_completion_tokens")
        );
        assert!(err.body.error.message.contains("(5 > 8 - 4)"));
        let mut ids_fit = parse(
            Endpoint::Completions,
            r#"{"prompt":[1,2,3],"max_tokens":5}"#,
        );
        assert!(check(&mut ids_fit, 8, None).is_ok());
        let mut long_prompt = parse(Endpoint::Completions, r#"{"prompt":[1,2,3,4]}"#);
        assert_eq!(
            check(&mut long_prompt, 4, None)
                .unwrap_err()
                .body
                .error
                .param
                .as_deref(),
            Some("prompt")
        );
        // A chat counted by the gateway's tokenizer is checked exactly.
        let mut counted = parse(Endpoint::Chat, r#"{"messages":[],"max_tokens":5}"#);
        let err = check(&mut counted, 8, Some(4)).unwrap_err();
        assert!(
            err.body.error.message.contains("your request has 4 input"),
            "{}",
            err.body.error.message
        );
        assert!(check(&mut counted, 9, Some(4)).is_ok());
    }
}
