//! What every worker request passes through, as tower layers rather than code in the
//! handlers: a request id (the caller's `X-Request-Id`, else a fresh UUID, echoed in the
//! response), one access-log line per request (target `pdserve::access`, as the
//! gateway's; at info level, but debug for metrics scrapes and health probes), the
//! `--api-key` check on the OpenAI routes and the
//! `--max-body-bytes` limit.

use std::time::Instant;

pub use crate::args::DEFAULT_MAX_BODY_BYTES;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http::{header, StatusCode};
use pdserve_protocol::ApiError;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use tracing::Level;

/// The header carrying a request's id.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// HTTP options of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// With a key, the OpenAI routes want `Authorization: Bearer <key>` (else 401).
    pub api_key: Option<String>,
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// Whether `path` is a route `--api-key` guards: the OpenAI API and the native
/// `/generate`. Health, metrics, server info and the profiler stay open (as vLLM's).
pub fn is_guarded(path: &str) -> bool {
    path.starts_with("/v1/") || path == "/generate"
}

/// The level of a request's span and access-log line: debug for the paths a gateway or
/// an orchestrator polls while the worker idles (`/metrics` every second, `/health`), so
/// an idle worker's log stays quiet; info for everything else.
pub fn access_level(path: &str) -> Level {
    match path {
        "/metrics" | "/health" => Level::DEBUG,
        _ => Level::INFO,
    }
}

/// `router` under the worker's layers.
pub fn apply<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    options: &HttpOptions,
) -> Router<S> {
    let mut router = router.layer(DefaultBodyLimit::max(options.max_body_bytes));
    if let Some(key) = options.api_key.clone().filter(|k| !k.is_empty()) {
        let expected = format!("Bearer {key}");
        router = router.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let authorized = authorized(&req, &expected);
                async move {
                    if authorized {
                        next.run(req).await
                    } else {
                        unauthorized()
                    }
                }
            },
        ));
    }
    if pdserve_telemetry::enabled() {
        // The request's server span (tracing on only: otherwise no layer, no cost).
        router = router.layer(axum::middleware::from_fn(
            pdserve_telemetry::http::trace_requests,
        ));
    }
    router
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request<Body>| {
                    let id = req
                        .headers()
                        .get(REQUEST_ID_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    let path = req.uri().path();
                    // `span!` wants its level fixed at the call site.
                    if access_level(path) == Level::DEBUG {
                        tracing::debug_span!(
                            "request",
                            request_id = %id,
                            method = %req.method(),
                            path = %path,
                        )
                    } else {
                        tracing::info_span!(
                            "request",
                            request_id = %id,
                            method = %req.method(),
                            path = %path,
                        )
                    }
                })
                // The access line is `log_access`'s, which knows the path.
                .on_request(())
                .on_response(())
                .on_failure(()),
        )
        // Outside the request's span, so the line reads as the gateway's: the span would
        // prefix it with the fields the line carries itself.
        .layer(axum::middleware::from_fn(log_access))
        // Outermost: every request, and so its log line and response, has an id.
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// Logs the access line of a request in the gateway's format (request id, method, path,
/// status, latency to the response head: a stream may run on) at [`access_level`].
async fn log_access(req: Request, next: Next) -> Response {
    let level = access_level(req.uri().path());
    let request_id = req.headers().get(REQUEST_ID_HEADER).cloned();
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let started = Instant::now();
    let res = next.run(req).await;
    let request_id = request_id
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let status = res.status().as_u16();
    let latency_ms = started.elapsed().as_secs_f64() * 1e3;
    // `event!` wants its level fixed at the call site.
    if level == Level::DEBUG {
        tracing::debug!(target: "pdserve::access", %request_id, %method, %path, status, latency_ms, "request");
    } else {
        tracing::info!(target: "pdserve::access", %request_id, %method, %path, status, latency_ms, "request");
    }
    res
}

fn authorized(req: &Request, expected: &str) -> bool {
    if !is_guarded(req.uri().path()) {
        return true;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    constant_time_eq(given, expected.as_bytes())
}

/// Compares without returning early at the first differing byte (the key is a secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &byte) in b.iter().enumerate() {
        diff |= usize::from(byte ^ a.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

fn unauthorized() -> Response {
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_api_key",
        "missing or wrong API key: send `Authorization: Bearer <key>`",
    )
    .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_api_routes_are_guarded_and_keys_compare_exactly() {
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/generate",
        ] {
            assert!(is_guarded(path), "{path}");
        }
        for path in [
            "/health",
            "/metrics",
            "/server_info",
            "/start_profile",
            "/v1",
        ] {
            assert!(!is_guarded(path), "{path}");
        }
        assert!(constant_time_eq(b"Bearer k", b"Bearer k"));
        assert!(!constant_time_eq(b"Bearer kk", b"Bearer k"));
        assert!(!constant_time_eq(b"Bearer ", b"Bearer k"));
        assert!(!constant_time_eq(b"", b"Bearer k"));
    }

    #[test]
    fn scrapes_and_probes_log_at_debug_and_everything_else_at_info() {
        // The gateway scrapes `/metrics` every second and probes `/health`: at info an
        // idle worker would log two lines a second.
        for path in ["/metrics", "/health"] {
            assert_eq!(access_level(path), Level::DEBUG, "{path}");
        }
        for path in [
            "/v1/completions",
            "/v1/chat/completions",
            "/generate",
            "/server_info",
            "/dashboard/data",
            "/metrics/extra",
            "/healthz",
        ] {
            assert_eq!(access_level(path), Level::INFO, "{path}");
        }
    }
}
