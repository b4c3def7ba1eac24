//! One access-log line per request at info (target `pdserve::access`): request id,
//! method, path, status and latency to the response head (a stream's body may run on).

use std::time::Instant;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// The request id header shared by the client response and both upstream legs.
pub const X_REQUEST_ID: &str = "x-request-id";

/// Middleware: logs the request once its response head is ready. Runs inside the
/// request-id layer, so every line carries the id the workers also got.
pub async fn log(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let request_id = request
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let response = next.run(request).await;
    tracing::info!(
        target: "pdserve::access",
        request_id,
        %method,
        path,
        status = response.status().as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
    response
}
