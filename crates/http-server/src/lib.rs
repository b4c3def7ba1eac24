//! The HTTP/1.1 accept loop shared by `pdserve gateway` and `pdserve worker`.
//!
//! `axum::serve` has no read timeouts and no connection cap: a client that sends half its
//! headers or half its body holds a connection (and its task) forever, and enough of them
//! exhaust the process's file descriptors. This loop serves an axum [`Router`] with
//! hyper's header read timeout, a deadline for each request body, a cap on open
//! connections, and the same graceful drain as `axum::serve(..).with_graceful_shutdown`.

mod body;
pub mod dashboard;
mod port;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::Router;
use http_body::Body as _;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

pub use body::{is_body_read_timeout, BodyReadTimeout};
pub use port::free_local_port;

/// Limits every connection is served under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// Longest wait for a complete request head (also closes a keep-alive connection that
    /// sends no next request for this long).
    pub header_read_timeout: Duration,
    /// Longest time from a request's head to the end of its body; past it the handler's
    /// body read fails with [`BodyReadTimeout`], the client gets 408 whatever the handler
    /// answered, and the connection is closed.
    pub body_read_timeout: Duration,
    /// Most open connections; further ones wait, not accepted, in the listen backlog
    /// until one closes. 0: no cap.
    pub max_connections: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 4096,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting, lets
/// every open request finish (idle keep-alive connections are closed at once) and returns
/// when the last connection has closed. Handlers can take `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let permits = match options.max_connections {
        0 => Semaphore::MAX_PERMITS,
        n => n.min(Semaphore::MAX_PERMITS),
    };
    let slots = Arc::new(Semaphore::new(permits));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        // Take a slot before accepting: over the cap, connections wait in the backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Stream chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds
        // each one back until the client's delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let app = app.clone();
        let body_limit = options.body_read_timeout;
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let expired = Arc::new(AtomicBool::new(false));
            let request = prepare(request, peer, body_limit, &expired);
            let response = app.clone().oneshot(request);
            async move {
                let response = response.await?;
                // However the handler turned the failed body read into a response, the
                // client gets 408 and the connection closes (hyper closes a connection
                // whose request body was not read to the end).
                if expired.load(Ordering::Relaxed) {
                    return Ok(body::timeout_response(body_limit));
                }
                Ok::<_, Infallible>(response)
            }
        });
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// The request as the router sees it: the body under its deadline, the peer address.
fn prepare(
    request: http::Request<Incoming>,
    peer: SocketAddr,
    body_limit: Duration,
    expired: &Arc<AtomicBool>,
) -> http::Request<Body> {
    let (mut parts, incoming) = request.into_parts();
    parts.extensions.insert(ConnectInfo(peer));
    // A bodyless request (GET, Content-Length: 0) needs no timer.
    let body = if incoming.is_end_stream() {
        Body::new(incoming)
    } else {
        Body::new(body::Deadline::new(incoming, body_limit, expired.clone()))
    };
    http::Request::from_parts(parts, body)
}

/// Accept errors other than a connection's own (EMFILE, ENOMEM) would repeat at once:
/// wait a second, as `axum::serve` does.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!("accept error: {e}");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
