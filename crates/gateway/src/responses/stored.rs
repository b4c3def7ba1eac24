//! `GET` and `DELETE /v1/responses/{id}`, answered from the history store; a response
//! the store does not hold (one only a worker stored) is asked of the worker that says it
//! has it.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::future::select_ok;
use http::{HeaderMap, Method};
use pdserve_protocol::{ApiError, WorkerRole};
use reqwest::Url;
use serde_json::json;

use crate::clients::worker_client::{Exchange, ForwardHeaders};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::legs::answer::json_response;
use crate::serving::Serving;
use crate::sessions::history_items::store_error;

use super::edits::stored_handle;

/// The metrics label of both routes.
const ROUTE: &str = "/v1/responses/{id}";

/// Handles `GET /v1/responses/{id}`.
pub async fn retrieve(
    State(state): State<Arc<Serving>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    stored(&state, &id, &headers, Method::GET).await
}

/// Handles `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<Serving>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    stored(&state, &id, &headers, Method::DELETE).await
}

async fn stored(state: &Arc<Serving>, id: &str, headers: &HeaderMap, method: Method) -> Response {
    let forward = ForwardHeaders::from_client(headers);
    let response = match send(state, id, &forward, &method).await {
        Ok(body) => json_response(body),
        Err(failure) => failure.into_response(),
    };
    state
        .metrics
        .record_request(ROUTE, response.status().as_u16());
    response
}

/// The answer to `method` on response `id`: the store's, else its holder's; a 404 when
/// none holds it, a 503 when the store cannot say.
async fn send(
    state: &Arc<Serving>,
    id: &str,
    headers: &ForwardHeaders,
    method: &Method,
) -> Result<Bytes, Failure> {
    if state.history.enabled() {
        let started = Instant::now();
        let stored = state.history.response(id).await;
        state
            .metrics
            .observe_history("read", started.elapsed(), stored.is_ok());
        if let Some(stored) = stored.map_err(store_error)? {
            if *method != Method::DELETE {
                return Ok(Bytes::from(
                    serde_json::to_vec(&stored.response).unwrap_or_default(),
                ));
            }
            state
                .history
                .delete_response(id)
                .await
                .map_err(store_error)?;
            // The decode side's handle for a next turn that can no longer come.
            state.conversations.take(id);
            let (owner, _) = stored_handle(&stored, state.conversations.ttl());
            forget_on_worker(state, owner.as_deref(), id, headers).await;
            let deleted = json!({"id": id, "object": "response", "deleted": true});
            return Ok(Bytes::from(deleted.to_string()));
        }
    }
    let worker = locate(state, headers, id)
        .await
        .ok_or_else(|| not_found(id))?;
    let url = response_url(&worker, id).ok_or_else(|| not_found(id))?;
    let request = match *method {
        Method::DELETE => state.client.delete(&url, headers),
        _ => state.client.get(&url, headers),
    };
    let exchange = Exchange::new(&worker, "worker", state.settings.decode_timeout);
    let body = exchange.send_and_read(request).await.map_err(|e| {
        state.report(&worker, &e);
        e.failure
    })?;
    if *method == Method::DELETE {
        state.conversations.take(id);
    }
    Ok(body)
}

/// OpenAI's 404 for response `id`.
fn not_found(id: &str) -> Failure {
    ApiError::not_found(format!("Response with id '{id}' not found."))
        .with_param("response_id")
        .into()
}

/// Deletes response `id` on the worker that answered it too, where that worker stored
/// it (the client asked for `store`): best effort, bounded by the health probe's
/// timeout, since the store's copy is the one clients read.
async fn forget_on_worker(
    state: &Arc<Serving>,
    owner: Option<&str>,
    id: &str,
    headers: &ForwardHeaders,
) {
    let roster = state.registry.snapshot();
    let Some(worker) = owner.and_then(|o| roster.get(o)).map(|m| m.worker.clone()) else {
        return;
    };
    let Some(url) = response_url(&worker, id) else {
        return;
    };
    let exchange = Exchange::new(&worker, "worker", state.settings.probe_timeout);
    // A worker that did not store it answers 404: nothing to undo.
    let _ = exchange.send(state.client.delete(&url, headers)).await;
}

/// `/v1/responses/{id}` on `worker` (the id one path segment, escaped).
fn response_url(worker: &Worker, id: &str) -> Option<Url> {
    let mut url = worker.url(Endpoint::Responses).clone();
    url.path_segments_mut().ok()?.push(id);
    Some(url)
}

/// The live decode or aggregated worker that holds response `id`: asked all at once, the
/// first that answers 200 (each within the health probe's timeout).
pub(super) async fn locate(
    state: &Arc<Serving>,
    headers: &ForwardHeaders,
    id: &str,
) -> Option<Arc<Worker>> {
    let roster = state.registry.snapshot();
    let asks: Vec<_> = [WorkerRole::Decode, WorkerRole::PrefillDecode]
        .into_iter()
        .flat_map(|role| roster.live(role).iter().cloned())
        .filter_map(|worker| {
            let url = response_url(&worker, id)?;
            let request = state.client.get(&url, headers);
            let limit = state.settings.probe_timeout;
            Some(Box::pin(async move {
                let exchange = Exchange::new(&worker, "worker", limit);
                exchange.send(request).await.map(|_| worker.clone())
            }))
        })
        .collect();
    if asks.is_empty() {
        return None;
    }
    let (worker, _) = select_ok(asks).await.ok()?;
    Some(worker)
}
