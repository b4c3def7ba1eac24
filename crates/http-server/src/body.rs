//! A request body that must arrive by a deadline.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

type BoxError = Box<dyn Error + Send + Sync>;

/// The body was not complete within the body read timeout.
#[derive(Debug, Clone, Copy)]
pub struct BodyReadTimeout(pub Duration);

impl std::fmt::Display for BodyReadTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body was not received within {:?}", self.0)
    }
}

impl Error for BodyReadTimeout {}

/// Whether `error` or one of its causes is a [`BodyReadTimeout`] (a handler's body
/// rejection wraps it).
pub fn is_body_read_timeout(error: &(dyn Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.is::<BodyReadTimeout>() {
            return true;
        }
        current = e.source();
    }
    false
}

/// The 408 a client gets when its body did not arrive in time (OpenAI-shaped, like the
/// rest of the API's errors).
pub(crate) fn timeout_response(limit: Duration) -> http::Response<axum::body::Body> {
    let body = format!(
        r#"{{"error":{{"message":"{}","type":"invalid_request_error","param":null,"code":"request_timeout"}}}}"#,
        BodyReadTimeout(limit)
    );
    let mut response = http::Response::new(axum::body::Body::from(body));
    *response.status_mut() = http::StatusCode::REQUEST_TIMEOUT;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    response
}

/// `inner`, failing with [`BodyReadTimeout`] once its deadline passes (and saying so in
/// `expired`).
pub(crate) struct Deadline<B> {
    inner: B,
    limit: Duration,
    timer: Pin<Box<Sleep>>,
    expired: Arc<AtomicBool>,
}

impl<B> Deadline<B> {
    /// `inner`, due within `limit` from now.
    pub(crate) fn new(inner: B, limit: Duration, expired: Arc<AtomicBool>) -> Self {
        Self {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
            expired,
        }
    }
}

impl<B> Body for Deadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if this.timer.as_mut().poll(cx).is_ready() {
            this.expired.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(Box::new(BodyReadTimeout(this.limit)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
