//! One access-log line per request at info (target `pdserve::access`): request id,
//! method, path, status and latency to the response head (a stream's body may run on).
//!
//! A plain tower layer rather than `from_fn`: every request passes it, and a `from_fn`
//! middleware boxes a copy of the service stack below it, and its own future, per
//! request.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use axum::extract::Request;
use axum::response::Response;
use http::{HeaderValue, Method, Uri};
use tower::{Layer, Service};

/// The request id header shared by the client response and both upstream legs.
pub const X_REQUEST_ID: &str = "x-request-id";

/// Logs each request once its response head is ready. Goes inside the request-id
/// layer, so every line carries the id the workers also got.
#[derive(Debug, Clone, Copy, Default)]
pub struct AccessLogLayer;

impl<S> Layer<S> for AccessLogLayer {
    type Service = AccessLog<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AccessLog { inner }
    }
}

/// The service [`AccessLogLayer`] wraps around the routes.
#[derive(Debug, Clone)]
pub struct AccessLog<S> {
    inner: S,
}

impl<S> Service<Request> for AccessLog<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Logged<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let line = AccessLine {
            started: Instant::now(),
            method: request.method().clone(),
            uri: request.uri().clone(),
            request_id: request.headers().get(X_REQUEST_ID).cloned(),
        };
        Logged {
            inner: self.inner.call(request),
            line: Some(line),
        }
    }
}

/// What the line says about the request, taken before it is served.
#[derive(Debug)]
struct AccessLine {
    started: Instant,
    method: Method,
    uri: Uri,
    request_id: Option<HeaderValue>,
}

impl AccessLine {
    fn log(self, response: &Response) {
        let request_id = self
            .request_id
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        tracing::info!(
            target: "pdserve::access",
            %request_id,
            method = %self.method,
            path = %self.uri.path(),
            status = response.status().as_u16(),
            latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
            "request"
        );
    }
}

pin_project_lite::pin_project! {
    /// The routes' future, logging the request when the response head is ready.
    pub struct Logged<F> {
        #[pin]
        inner: F,
        line: Option<AccessLine>,
    }
}

impl<F, E> Future for Logged<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(cx));
        if let (Ok(response), Some(line)) = (&result, this.line.take()) {
            line.log(response);
        }
        Poll::Ready(result)
    }
}
