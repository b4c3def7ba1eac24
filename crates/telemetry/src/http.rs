//! The server span of every HTTP request a process serves, when tracing is on: the
//! caller's `traceparent` is its parent, handlers run with it as the current context,
//! and it ends when the response body has been sent (a stream's last event).

use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use axum::body::Body;
use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use http_body::Frame;
use opentelemetry::context::FutureExt;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};

use crate::semconv;

/// axum middleware: the request's server span. Install it only when [`crate::enabled`]:
/// the routes then pay nothing when tracing is off.
pub async fn trace_requests(request: Request, next: Next) -> Response {
    let Some(tracer) = crate::tracer().filter(|_| traced(request.uri().path())) else {
        return next.run(request).await;
    };
    let parent = crate::propagation::extract(request.headers());
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let path = request.uri().path().to_owned();
    let name = format!("{method} {}", route.as_deref().unwrap_or(&path));
    let operation = operation(route.as_deref().unwrap_or(&path));
    let mut attributes = vec![
        KeyValue::new(semconv::HTTP_REQUEST_METHOD, method),
        KeyValue::new(semconv::URL_PATH, path),
    ];
    if let Some(operation) = operation {
        attributes.push(KeyValue::new(semconv::GEN_AI_OPERATION_NAME, operation));
    }
    if let Some(route) = route {
        attributes.push(KeyValue::new(semconv::HTTP_ROUTE, route));
    }
    if let Some(id) = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
    {
        attributes.push(KeyValue::new(semconv::GEN_AI_REQUEST_ID, id.to_owned()));
    }
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    let cx = parent.with_span(span);
    let response = next.run(request).with_context(cx.clone()).await;
    let status = response.status();
    cx.span().set_attribute(KeyValue::new(
        semconv::HTTP_RESPONSE_STATUS_CODE,
        i64::from(status.as_u16()),
    ));
    if status.is_server_error() {
        cx.span().set_status(Status::error(status.to_string()));
    }
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, Body::new(SpanBody { body, _cx: cx }))
}

/// Whether requests to `path` get a span: the API routes, not probes and scrapes
/// (`/health`, `/metrics`, `/v1/models`, pages), which would bury the requests in
/// traces of their own.
fn traced(path: &str) -> bool {
    (path.starts_with("/v1/") && path != "/v1/models")
        || matches!(path, "/generate" | "/tokenize" | "/detokenize")
}

/// GenAI's `gen_ai.operation.name` of a generation route.
fn operation(route: &str) -> Option<&'static str> {
    match route {
        "/v1/chat/completions" | "/v1/responses" => Some("chat"),
        "/v1/completions" => Some("text_completion"),
        "/generate" => Some("generate_content"),
        _ => None,
    }
}

/// A response body that holds its request's span open until it is dropped.
struct SpanBody {
    body: Body,
    _cx: Context,
}

impl http_body::Body for SpanBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
