//! Engine errors as clients see them: an HTTP status and an OpenAI-shaped body.

use axum::response::{IntoResponse, Response};
use http::header;
use pdserve_protocol::{ApiError, ErrorBody};

use crate::kv::HandoffError;
use crate::orchestrator::{OrchestrateError, PrefillError};
use crate::scheduler::SubmitError;

/// A failed prefill leg as the orchestrator's client sees it: a prefill worker's 4xx
/// with its own status and OpenAI body, a timeout as 504, anything else as 502.
impl From<PrefillError> for ApiError {
    fn from(e: PrefillError) -> Self {
        let message = e.to_string();
        match e {
            PrefillError::Rejected { status, body, .. } => {
                match serde_json::from_slice::<ErrorBody>(&body) {
                    Ok(body) => ApiError { status, body },
                    Err(_) => ApiError::new(
                        status,
                        "upstream_error",
                        format!("{message}: {}", String::from_utf8_lossy(&body).trim()),
                    ),
                }
            }
            PrefillError::TimedOut { .. } => ApiError::gateway_timeout(message),
            PrefillError::Failed { .. }
            | PrefillError::Unreachable { .. }
            | PrefillError::Broken { .. }
            | PrefillError::BadAnswer { .. } => ApiError::bad_gateway(message),
        }
    }
}

impl IntoResponse for OrchestrateError {
    fn into_response(self) -> Response {
        match self {
            Self::Api(e) => e.into_response(),
            Self::Prefill(e) => e.into_response(),
        }
    }
}

impl IntoResponse for PrefillError {
    /// A prefill worker's OpenAI-shaped 4xx is passed on byte for byte.
    fn into_response(self) -> Response {
        match self {
            PrefillError::Rejected { status, body, .. }
                if serde_json::from_slice::<ErrorBody>(&body).is_ok() =>
            {
                (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
            }
            other => ApiError::from(other).into_response(),
        }
    }
}

impl From<HandoffError> for ApiError {
    fn from(e: HandoffError) -> Self {
        let message = e.to_string();
        match e {
            HandoffError::ConflictingDirections
            | HandoffError::MissingField(_)
            | HandoffError::PeerNotAllowed { .. }
            | HandoffError::BadPublishId(_) => {
                ApiError::bad_request(message).with_param("kv_transfer_params")
            }
            HandoffError::PullTimedOut { .. } => ApiError::gateway_timeout(message),
            HandoffError::PeerRefused { .. }
            | HandoffError::PullFailed { .. }
            | HandoffError::PromptNotCovered { .. } => ApiError::bad_gateway(message),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull(_) => ApiError::too_many_requests(e.to_string()),
            SubmitError::Stopped => ApiError::service_unavailable(e.to_string()),
            SubmitError::PriorityNotEnabled => {
                ApiError::bad_request(e.to_string()).with_param("priority")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use pdserve_kv_transfer::{ErrorCode, TransferError};

    fn status_and_param(e: HandoffError) -> (StatusCode, Option<String>, String) {
        let message = e.to_string();
        let api = ApiError::from(e);
        assert_eq!(api.body.error.message, message);
        (api.status, api.body.error.param, message)
    }

    #[test]
    fn handoff_errors_keep_their_statuses_and_messages() {
        let (status, param, message) = status_and_param(HandoffError::ConflictingDirections);
        assert_eq!(
            (status, param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("kv_transfer_params"))
        );
        assert!(message.contains("exclude each other"), "{message}");
        let (status, param, message) = status_and_param(HandoffError::MissingField("remote_port"));
        assert_eq!(
            (status, param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("kv_transfer_params"))
        );
        assert_eq!(
            message,
            "kv_transfer_params.remote_port is required to read KV from a peer"
        );

        let timeout = HandoffError::pull("p:1", TransferError::Timeout("reading a frame"));
        assert!(matches!(timeout, HandoffError::PullTimedOut { .. }));
        let (status, param, message) = status_and_param(timeout);
        assert_eq!((status, param), (StatusCode::GATEWAY_TIMEOUT, None));
        assert!(
            message.starts_with("reading KV blocks from p:1 failed: "),
            "{message}"
        );

        let refused = TransferError::Remote {
            code: ErrorCode::UnknownRequest,
            message: "gone".into(),
        };
        let refused = HandoffError::pull("p:1", refused);
        assert!(matches!(refused, HandoffError::PeerRefused { .. }));
        assert_eq!(status_and_param(refused).0, StatusCode::BAD_GATEWAY);
        let broken = HandoffError::pull("p:1", TransferError::Protocol("garbage".into()));
        assert!(matches!(broken, HandoffError::PullFailed { .. }));
        assert_eq!(status_and_param(broken).0, StatusCode::BAD_GATEWAY);

        let (status, _, message) = status_and_param(HandoffError::PromptNotCovered {
            covered: 3,
            prompt_tokens: 40,
        });
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert!(
            message.contains("covers only 3 of this prompt's 40 tokens"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn prefill_errors_pass_4xx_on_and_make_the_rest_502_or_504() {
        let url = "http://p:1".to_string();
        let body = bytes::Bytes::from(
            r#"{"error":{"message":"too long","type":"invalid_request_error","param":"prompt","code":"x","extra":1}}"#,
        );
        let rejected = PrefillError::Rejected {
            url: url.clone(),
            status: StatusCode::BAD_REQUEST,
            body: body.clone(),
        };
        let response = rejected.into_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let got = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .unwrap();
        assert_eq!(got, body, "the 4xx body is passed on unchanged");
        let plain = PrefillError::Rejected {
            url: url.clone(),
            status: StatusCode::NOT_FOUND,
            body: "nope".into(),
        };
        let api = ApiError::from(plain);
        assert_eq!(api.status, StatusCode::NOT_FOUND);
        assert!(api.body.error.message.contains("nope"), "{api}");
        let failed = PrefillError::Failed {
            url: url.clone(),
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "boom".into(),
        };
        assert_eq!(failed.into_response().status(), StatusCode::BAD_GATEWAY);
        let timed_out = PrefillError::TimedOut {
            url,
            limit: std::time::Duration::from_secs(2),
        };
        assert_eq!(
            ApiError::from(timed_out).status,
            StatusCode::GATEWAY_TIMEOUT
        );
    }

    #[test]
    fn submit_errors_are_429_and_503() {
        assert_eq!(
            ApiError::from(SubmitError::QueueFull(4)).status,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            ApiError::from(SubmitError::Stopped).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
