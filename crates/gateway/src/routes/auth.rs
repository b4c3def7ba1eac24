//! `--api-key`: the OpenAI routes want `Authorization: Bearer <key>` (vLLM's `--api-key`);
//! health, readiness, metrics and the admin API (its own key) stay open.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, StatusCode};
use pdserve_protocol::ApiError;
use subtle::ConstantTimeEq;

/// Whether `path` is one of the routes `--api-key` protects (`/v1/*`, SGLang's
/// `/generate`).
pub fn is_protected(path: &str) -> bool {
    path.starts_with("/v1/") || path == "/generate"
}

/// Whether `authorization` is `Bearer <key>`, compared in constant time (a timing
/// difference would let a client find the key byte by byte).
pub fn authorized(authorization: Option<&[u8]>, key: &str) -> bool {
    let Some(offered) = authorization.and_then(|v| v.strip_prefix(b"Bearer ")) else {
        return false;
    };
    offered.ct_eq(key.as_bytes()).into()
}

/// The key clients of the OpenAI routes must present (`--api-key`); `None`: open.
#[derive(Debug, Clone, Default)]
pub struct ApiKey(pub Option<Arc<str>>);

/// Middleware: 401 on a protected route without the key; everything else passes.
pub async fn require_api_key(
    State(ApiKey(key)): State<ApiKey>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = key.as_deref() else {
        return next.run(request).await;
    };
    if !is_protected(request.uri().path()) {
        return next.run(request).await;
    }
    let offered = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if authorized(offered, key) {
        return next.run(request).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_api_key",
        "Missing or incorrect API key: send `Authorization: Bearer <key>`.",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_key_must_match_exactly() {
        assert!(authorized(Some(b"Bearer k1"), "k1"));
        for wrong in [
            None,
            Some(&b"Bearer k2"[..]),
            Some(b"Bearer k1x"),
            Some(b"bearer k1"),
            Some(b"k1"),
            Some(b"Bearer "),
        ] {
            assert!(!authorized(wrong, "k1"), "{wrong:?}");
        }
        assert!(is_protected("/v1/chat/completions"));
        assert!(is_protected("/v1/models"));
        assert!(is_protected("/generate"));
        for open in [
            "/health",
            "/readiness",
            "/liveness",
            "/metrics",
            "/instances",
        ] {
            assert!(!is_protected(open), "{open}");
        }
    }
}
