//! Engine errors as clients see them: an HTTP status and an OpenAI-shaped body.

use pdserve_protocol::ApiError;

use crate::kv::HandoffError;
use crate::scheduler::SubmitError;

impl From<HandoffError> for ApiError {
    fn from(e: HandoffError) -> Self {
        let message = e.to_string();
        match e {
            HandoffError::ConflictingDirections | HandoffError::MissingField(_) => {
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
