//! Errors: those that stop the gateway, and those that end one client request.

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use pdserve_protocol::ApiError;
use serde_json::Value;

/// Errors that stop a gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The flags or configuration are invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// The HTTP client for upstream workers could not be built.
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// The server stopped with an I/O error.
    #[error("server error: {0}")]
    Serve(#[from] std::io::Error),
}

/// Why one client request failed, as the response the client gets.
#[derive(Debug)]
pub enum Failure {
    /// An error produced by the gateway.
    Api(ApiError),
    /// A worker's 4xx, passed through with its own OpenAI-shaped body.
    Upstream {
        /// The worker's status.
        status: StatusCode,
        /// The worker's JSON body, unchanged.
        body: Bytes,
    },
}

impl Failure {
    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Api(e) => e.status,
            Self::Upstream { status, .. } => *status,
        }
    }

    /// A worker's client error: passed through when its body is OpenAI-shaped JSON (an
    /// `error` object, or vLLM's older flat `{"object": "error", "message": ...}`), else
    /// wrapped into one with the same status.
    pub fn from_upstream_client_error(status: StatusCode, body: Bytes, worker: &str) -> Self {
        let openai_shaped = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.as_object().cloned())
            .is_some_and(|o| o.contains_key("error") || o.contains_key("message"));
        if openai_shaped {
            return Self::Upstream { status, body };
        }
        let text = String::from_utf8_lossy(&body);
        let text = text.trim();
        Self::Api(ApiError::new(
            status,
            "upstream_error",
            format!("worker {worker} answered {status}: {}", truncate(text, 512)),
        ))
    }
}

impl Failure {
    /// The failure as the gateway's own error (a worker's 4xx keeps its status and
    /// message), for a stream whose head was already sent: it ends with an error event.
    pub fn into_api_error(self) -> ApiError {
        match self {
            Self::Api(e) => e,
            Self::Upstream { status, body } => {
                let json = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
                let message = json
                    .pointer("/error/message")
                    .or_else(|| json.get("message"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
                ApiError::new(status, "upstream_error", message)
            }
        }
    }
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Self::Api(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Self::Api(e) => e.into_response(),
            Self::Upstream { status, body } => (
                status,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body,
            )
                .into_response(),
        }
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

pub use pdserve_protocol::error_chain;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_openai_bodies_and_wraps_others() {
        let body = Bytes::from_static(
            br#"{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#,
        );
        match Failure::from_upstream_client_error(StatusCode::BAD_REQUEST, body.clone(), "w") {
            Failure::Upstream { status, body: b } => {
                assert_eq!(status, StatusCode::BAD_REQUEST);
                assert_eq!(b, body);
            }
            other => panic!("{other:?}"),
        }
        match Failure::from_upstream_client_error(
            StatusCode::NOT_FOUND,
            Bytes::from_static(b"nope"),
            "w",
        ) {
            Failure::Api(e) => {
                assert_eq!(e.status, StatusCode::NOT_FOUND);
                assert!(e.body.error.message.contains("nope"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(truncate("héllo", 2), "h");
    }
}
