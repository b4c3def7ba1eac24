//! `GET` and `DELETE /v1/responses/{id}`, sent to the worker that holds the response:
//! the one remembered as its owner, else the first worker that says it has it.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::future::select_ok;
use http::{HeaderMap, Method};
use pdserve_protocol::{ApiError, WorkerRole};
use reqwest::Url;
use serde_json::{json, Value};

use crate::clients::worker_client::{Exchange, ForwardHeaders};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::legs::answer::json_response;
use crate::serving::Serving;

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

/// The holder's answer to `method` on response `id`; its 404 when none holds it.
async fn send(
    state: &Arc<Serving>,
    id: &str,
    headers: &ForwardHeaders,
    method: &Method,
) -> Result<Bytes, Failure> {
    let not_found = || {
        Failure::from(
            ApiError::not_found(format!("Response with id '{id}' not found."))
                .with_param("response_id"),
        )
    };
    let record = state.responses.get(id);
    let known = record.as_ref().and_then(|r| {
        let roster = state.registry.snapshot();
        roster.get(&r.owner).map(|m| m.worker.clone())
    });
    let worker = match known {
        Some(worker) => worker,
        None => locate(state, headers, id).await.ok_or_else(not_found)?,
    };
    let url = response_url(&worker, id).ok_or_else(not_found)?;
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
        state.responses.remove(id);
        // The decode side's handle for a next turn that can no longer come.
        state.conversations.take(id);
        return Ok(body);
    }
    // The worker was sent the conversation written out when it answered over P/D, so it
    // does not know the response it continued; the gateway does.
    let previous = record.and_then(|r| r.previous);
    match (previous, serde_json::from_slice::<Value>(&body)) {
        (Some(previous), Ok(Value::Object(mut object))) => {
            object.insert("previous_response_id".into(), json!(previous));
            Ok(serde_json::to_vec(&object).map_or(body, Bytes::from))
        }
        _ => Ok(body),
    }
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
