//! OpenAI's Conversations API (`/v1/conversations`), answered from the history store:
//! conversations with metadata, and their items, in the shapes the OpenAI SDK reads.
//! Validation (OpenAI's limits: 20 items a call, 16 metadata pairs, a list's `limit` 1 to
//! 100) is here; what is kept and how is `pdserve_history`'s.

// The helpers return the handler's OpenAI-shaped error itself: boxing it would buy nothing
// on these paths, which wait on a database anyway.
#![allow(clippy::result_large_err)]

use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use pdserve_history::records::{check_metadata, MAX_ITEMS_PER_REQUEST};
use pdserve_history::{ListQuery, Metadata, Order};
use pdserve_protocol::ApiError;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::ingress::request::body_rejection;
use crate::serving::Serving;
use crate::sessions::history_items::{shape_item, store_error};
use crate::state::AppState;

/// A list's `limit` when none is given, and the most it may be.
const DEFAULT_LIMIT: usize = 20;
const MAX_LIMIT: usize = 100;

/// `POST /v1/conversations`: a conversation with optional `metadata` and first `items`.
pub async fn create(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(async {
        let body = object(body, app.config.max_body_bytes)?;
        let metadata = metadata(body.get("metadata"))?;
        let items = items(body.get("items"), false)?;
        let (conversation, _) = app
            .serving
            .history
            .create_conversation(metadata, items)
            .await
            .map_err(store_error)?;
        Ok(conversation.to_json())
    })
    .await
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    answer(async {
        let conversation = app
            .serving
            .history
            .conversation(&id)
            .await
            .map_err(store_error)?;
        Ok(conversation.ok_or_else(|| no_conversation(&id))?.to_json())
    })
    .await
}

/// `POST /v1/conversations/{id}`: replaces its `metadata`.
pub async fn update(
    State(app): State<AppState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(async {
        let body = object(body, app.config.max_body_bytes)?;
        if !body.contains_key("metadata") {
            return Err(
                ApiError::bad_request("Missing required parameter: 'metadata'.")
                    .with_param("metadata"),
            );
        }
        let metadata = metadata(body.get("metadata"))?;
        let updated = app
            .serving
            .history
            .update_conversation(&id, metadata)
            .await
            .map_err(store_error)?;
        Ok(updated.ok_or_else(|| no_conversation(&id))?.to_json())
    })
    .await
}

/// `DELETE /v1/conversations/{id}`.
pub async fn delete(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    answer(async {
        if !app
            .serving
            .history
            .delete_conversation(&id)
            .await
            .map_err(store_error)?
        {
            return Err(no_conversation(&id));
        }
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    })
    .await
}

/// `POST /v1/conversations/{id}/items`: appends `items`, in order.
pub async fn add_items(
    State(app): State<AppState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(async {
        let body = object(body, app.config.max_body_bytes)?;
        let items = items(body.get("items"), true)?;
        let added = app
            .serving
            .history
            .add_items(&id, items)
            .await
            .map_err(store_error)?
            .ok_or_else(|| no_conversation(&id))?;
        let page = pdserve_history::ItemPage {
            items: added,
            has_more: false,
        };
        Ok(page.to_json())
    })
    .await
}

/// A list's query string (`include` is accepted and has nothing to add: items are kept
/// whole).
#[derive(Debug, Deserialize)]
pub struct ListParams {
    after: Option<String>,
    limit: Option<String>,
    order: Option<String>,
}

/// `GET /v1/conversations/{id}/items`.
pub async fn list_items(
    State(app): State<AppState>,
    Path(id): Path<String>,
    Query(params): Query<ListParams>,
) -> Response {
    answer(async {
        let query = list_query(params)?;
        let page = app
            .serving
            .history
            .list_items(&id, query)
            .await
            .map_err(store_error)?
            .ok_or_else(|| no_conversation(&id))?;
        Ok(page.to_json())
    })
    .await
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn retrieve_item(
    State(app): State<AppState>,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    answer(async {
        if let Some(found) = app
            .serving
            .history
            .item(&id, &item)
            .await
            .map_err(store_error)?
        {
            return Ok(found.body);
        }
        Err(missing_item(&app.serving, &id, &item).await)
    })
    .await
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: answers with the conversation.
pub async fn delete_item(
    State(app): State<AppState>,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    answer(async {
        if !app
            .serving
            .history
            .delete_item(&id, &item)
            .await
            .map_err(store_error)?
        {
            return Err(missing_item(&app.serving, &id, &item).await);
        }
        let conversation = app
            .serving
            .history
            .conversation(&id)
            .await
            .map_err(store_error)?;
        Ok(conversation.ok_or_else(|| no_conversation(&id))?.to_json())
    })
    .await
}

/// The handler's JSON, or its OpenAI-shaped error.
async fn answer(handler: impl std::future::Future<Output = Result<Value, ApiError>>) -> Response {
    match handler.await {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

/// The request body as a JSON object.
fn object(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<Map<String, Value>, ApiError> {
    let body = body.map_err(|r| body_rejection(r, limit))?;
    if body.is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_slice(&body) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}"
        ))),
    }
}

/// `metadata` (absent or `null`: none), within OpenAI's limits.
fn metadata(value: Option<&Value>) -> Result<Metadata, ApiError> {
    let metadata = match value {
        None | Some(Value::Null) => Metadata::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(_) => {
            return Err(
                ApiError::bad_request("'metadata' must be an object of strings.")
                    .with_param("metadata"),
            )
        }
    };
    check_metadata(&metadata).map_err(|m| ApiError::bad_request(m).with_param("metadata"))?;
    Ok(metadata)
}

/// `items`: a list of at most 20 item objects, each with a `type` (a message by default)
/// and, for a message, a `role`; required when `required`.
fn items(value: Option<&Value>, required: bool) -> Result<Vec<Value>, ApiError> {
    let list = match value {
        None | Some(Value::Null) if !required => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => {
            return Err(
                ApiError::bad_request("Missing required parameter: 'items'.").with_param("items"),
            )
        }
        Some(_) => {
            return Err(ApiError::bad_request("'items' must be an array.").with_param("items"))
        }
    };
    if list.len() > MAX_ITEMS_PER_REQUEST {
        return Err(ApiError::bad_request(format!(
            "'items' has {} items; at most {MAX_ITEMS_PER_REQUEST} may be added at a time.",
            list.len()
        ))
        .with_param("items"));
    }
    list.iter()
        .enumerate()
        .map(|(i, item)| shape_item(item, &format!("items[{i}]")))
        .collect()
}

/// A list's query, checked.
fn list_query(params: ListParams) -> Result<ListQuery, ApiError> {
    let limit = match params.limit.as_deref() {
        None => DEFAULT_LIMIT,
        Some(text) => match text.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "Invalid 'limit': '{text}'. Expected an integer from 1 to {MAX_LIMIT}."
                ))
                .with_param("limit"))
            }
        },
    };
    let order = match params.order.as_deref() {
        None | Some("desc") => Order::Desc,
        Some("asc") => Order::Asc,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "Invalid 'order': '{other}'. Expected 'asc' or 'desc'."
            ))
            .with_param("order"))
        }
    };
    Ok(ListQuery {
        after: params.after,
        limit,
        order,
    })
}

fn no_conversation(id: &str) -> ApiError {
    ApiError::not_found(format!("Conversation with id '{id}' not found."))
        .with_param("conversation_id")
}

/// The 404 for an item that is not there: its conversation's, if that is missing too.
async fn missing_item(serving: &Serving, id: &str, item: &str) -> ApiError {
    match serving.history.conversation(id).await {
        Ok(None) => no_conversation(id),
        Err(e) => store_error(e),
        Ok(Some(_)) => ApiError::not_found(format!(
            "Item with id '{item}' not found in conversation '{id}'."
        ))
        .with_param("item_id"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_checked_and_completed_as_openai_returns_them() {
        let list = json!([{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": "yo"}]);
        let checked = items(Some(&list), true).unwrap();
        assert_eq!(checked[0]["type"], "message");
        assert_eq!(
            checked[0]["content"][0],
            json!({"type": "input_text", "text": "hi"})
        );
        assert_eq!(checked[1]["content"][0]["annotations"], json!([]));
        assert_eq!(checked[0]["status"], "completed");
        let no_role = json!([{"type": "message", "content": "x"}]);
        assert_eq!(
            items(Some(&no_role), true)
                .unwrap_err()
                .body
                .error
                .param
                .as_deref(),
            Some("items[0].role")
        );
        let many = Value::Array(vec![json!({"role": "user", "content": "x"}); 21]);
        assert!(items(Some(&many), true)
            .unwrap_err()
            .body
            .error
            .message
            .contains("at most 20"));
        assert!(items(None, true).is_err() && items(None, false).unwrap().is_empty());
    }

    #[test]
    fn a_list_query_takes_openais_defaults_and_bounds() {
        let params = |limit: Option<&str>, order: Option<&str>| ListParams {
            after: None,
            limit: limit.map(str::to_string),
            order: order.map(str::to_string),
        };
        let q = list_query(params(None, None)).unwrap();
        assert_eq!((q.limit, q.order), (20, Order::Desc));
        assert_eq!(
            list_query(params(Some("100"), Some("asc"))).unwrap().order,
            Order::Asc
        );
        for bad in ["0", "101", "x"] {
            assert!(list_query(params(Some(bad), None)).is_err(), "{bad}");
        }
        assert!(list_query(params(None, Some("up"))).is_err());
    }
}
