//! Reading a request's JSON body and writing an event-stream answer, as every route does.

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use http::{header, StatusCode};
use pdserve_protocol::ApiError;
use serde::de::DeserializeOwned;

/// Decodes a JSON body, answering OpenAI-shaped errors (axum's own rejections are plain
/// text).
pub fn parse_json<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|r| {
        let code = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            "payload_too_large"
        } else {
            "invalid_request"
        };
        ApiError::new(r.status(), code, r.body_text())
    })?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

/// A `text/event-stream` response over `events`.
pub fn sse_response<S>(events: S) -> Response
where
    S: Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response()
}
