//! OpenAI-shaped error bodies (`{"error": {"message", "type", "param", "code"}}`) with
//! the HTTP status they travel under.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The `error` object of an OpenAI error body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: Option<Value>,
}

/// An OpenAI error body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// An error answered to an API client: status plus OpenAI-shaped body.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {}", body.error.message)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
}

impl ApiError {
    /// An error with the OpenAI `type` that fits `status` and a machine-readable `code`.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        Self {
            status,
            body: ErrorBody {
                error: ErrorDetail {
                    message: message.into(),
                    kind: kind.to_string(),
                    param: None,
                    code: Some(Value::String(code.to_string())),
                },
            },
        }
    }

    /// Names the request field the error is about.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.body.error.param = Some(param.into());
        self
    }

    /// 400: the request is malformed or a field is invalid.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 404: the named model is not served here.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("The model `{model}` does not exist."),
        )
        .with_param("model")
    }

    /// 404: the named object (a stored response, ...) does not exist.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 413: the body exceeds the configured limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("Request body exceeds the limit of {limit} bytes."),
        )
    }

    /// 429: the server is at capacity.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", message)
    }

    /// 500: a bug or an unexpected state on this server.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// 502: an upstream answered an error or garbage, or could not be reached.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "bad_gateway", message)
    }

    /// 503: no worker can take the request.
    pub fn service_unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    /// 504: an upstream did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", message)
    }

    /// The error as a JSON value (for SSE error events).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(&self.body).unwrap_or(Value::Null)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

/// An error and all its causes, `: `-separated ("error sending request: connection
/// refused"): HTTP clients' own messages hide the cause. A cause whose text the message
/// already holds is left out: wrappers such as axum's `Error` print their cause as their
/// own message ("error reading a body from connection" twice).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that prints `text` and has `cause` as its source.
    #[derive(Debug)]
    struct Wrapped(&'static str, Option<Box<Wrapped>>);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn a_chain_names_each_cause_once() {
        let eof = Wrapped("unexpected EOF", None);
        let hyper = Wrapped("error reading a body from connection", Some(Box::new(eof)));
        let axum = Wrapped(
            "error reading a body from connection",
            Some(Box::new(hyper)),
        );
        assert_eq!(
            error_chain(&axum),
            "error reading a body from connection: unexpected EOF"
        );
        let refused = Wrapped("connection refused", None);
        let sent = Wrapped("error sending request", Some(Box::new(refused)));
        assert_eq!(
            error_chain(&sent),
            "error sending request: connection refused"
        );
    }

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::model_not_found("gpt-x");
        let v = e.to_json();
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert!(v["error"]["message"].as_str().unwrap().contains("gpt-x"));
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }
}
