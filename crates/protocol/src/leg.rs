//! How a request from one pdserve process to another (a gateway's leg to a worker, an
//! orchestrating worker's prefill leg) failed: one classification for both, each crate
//! keeping its own metrics labels and HTTP mapping.

use http::StatusCode;

/// How a leg to another server failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LegFault {
    /// No connection could be opened: the request never reached the server.
    Unreachable,
    /// The connection broke, or the answer could not be read as sent.
    Broken,
    /// No answer within the leg's time limit.
    TimedOut,
    /// The server answered 5xx (or another status that is neither 2xx nor 4xx).
    Failed,
    /// The server answered 4xx, or 508 from a gateway that detected a routing loop: the
    /// request itself is at fault, and another server would answer the same.
    Rejected,
    /// A 2xx whose body is not the answer the leg needs.
    BadAnswer,
}

impl LegFault {
    /// The fault an error `status` means; `None` for a success.
    pub fn of_status(status: StatusCode) -> Option<Self> {
        if status.is_success() {
            None
        } else if status.is_client_error() || status == StatusCode::LOOP_DETECTED {
            Some(Self::Rejected)
        } else {
            Some(Self::Failed)
        }
    }

    /// Whether the server failed (as opposed to the request being at fault): another
    /// server may succeed.
    pub fn is_server_fault(self) -> bool {
        self != Self::Rejected
    }

    /// Whether the server looks gone, not just this request failed.
    pub fn server_gone(self) -> bool {
        matches!(self, Self::Unreachable | Self::Broken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        assert_eq!(LegFault::of_status(StatusCode::OK), None);
        assert_eq!(
            LegFault::of_status(StatusCode::NOT_FOUND),
            Some(LegFault::Rejected)
        );
        assert_eq!(
            LegFault::of_status(StatusCode::LOOP_DETECTED),
            Some(LegFault::Rejected)
        );
        assert_eq!(
            LegFault::of_status(StatusCode::BAD_GATEWAY),
            Some(LegFault::Failed)
        );
        assert!(!LegFault::Rejected.is_server_fault() && LegFault::BadAnswer.is_server_fault());
        assert!(LegFault::Broken.server_gone() && !LegFault::TimedOut.server_gone());
    }
}
