//! A pooled HTTP/1.1 client for streamed legs whose connection is driven by the task that
//! reads the response.
//!
//! Through reqwest each connection runs in its own task and hands a chunked body over one
//! chunk at a time, each hand-over waiting for the reader to ask for the next: a stream
//! of N events cost N task switches, and N writes to the client, even when the worker's
//! N events came in one read. Here the reader polls the connection itself, so every
//! event already received is decoded in the same poll and relayed in one write.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::task::noop_waker_ref;
use futures::Stream;
use http::{HeaderMap, Request, StatusCode};
use http_body::Body as _;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

type Connection = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// Idle connections kept per worker at most (more are closed when returned).
const MAX_IDLE_PER_WORKER: usize = 1024;

/// Why an exchange on a direct connection failed.
#[derive(Debug, thiserror::Error)]
pub enum DirectError {
    /// No connection could be opened.
    #[error("could not connect to {addr}: {source}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The socket error.
        source: std::io::Error,
    },
    /// The connection did not open within the connect timeout.
    #[error("connecting to {0} timed out")]
    ConnectTimeout(String),
    /// The HTTP exchange failed (connection reset, bad framing, ...).
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

impl DirectError {
    /// Whether the request never reached the worker because no connection opened.
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. } | Self::ConnectTimeout(_))
    }
}

/// One open connection: the request sender and the connection state machine.
struct Conn {
    tx: http1::SendRequest<Full<Bytes>>,
    conn: Option<Connection>,
}

impl Conn {
    /// Drives the connection once; `true` while it is open.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        if Pin::new(conn).poll(cx).is_ready() {
            // Closed (or failed): dropping it ends any response still waiting on it.
            self.conn = None;
            return false;
        }
        true
    }

    /// Whether an idle connection can take a request now (the worker has not closed it).
    fn usable(&mut self) -> bool {
        let mut cx = Context::from_waker(noop_waker_ref());
        self.drive(&mut cx) && matches!(self.tx.poll_ready(&mut cx), Poll::Ready(Ok(())))
    }
}

#[derive(Debug, Default)]
struct Idle {
    by_addr: HashMap<String, Vec<(IdleConn, Instant)>>,
    /// When every worker's list was last cleared of expired connections.
    swept: Option<Instant>,
}

impl Idle {
    /// Closes expired connections of every worker, at most once per `timeout`: a worker
    /// that left the roster gets no more check-ins, and its idle sockets would stay open.
    fn sweep(&mut self, timeout: Duration, now: Instant) {
        if self
            .swept
            .is_some_and(|at| now.duration_since(at) < timeout)
        {
            return;
        }
        self.swept = Some(now);
        self.by_addr.retain(|_, list| {
            list.retain(|(_, since)| now.duration_since(*since) < timeout);
            !list.is_empty()
        });
    }
}

struct IdleConn(Conn);

impl std::fmt::Debug for IdleConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdleConn")
    }
}

/// The pool of direct connections to workers.
#[derive(Debug, Clone)]
pub struct DirectClient {
    idle: Arc<Mutex<Idle>>,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

impl DirectClient {
    /// A pool whose idle connections are retired after `idle_timeout` (before the
    /// workers' keep-alive closes them, as for the reqwest pool).
    pub fn new(idle_timeout: Duration, connect_timeout: Duration) -> Self {
        Self {
            idle: Arc::default(),
            idle_timeout,
            connect_timeout,
        }
    }

    /// Sends `request` to `addr` (`host:port`) on an idle connection, or a new one when
    /// none is usable; answers with the response head and its body stream.
    pub async fn send(
        &self,
        addr: &str,
        mut request: Request<Full<Bytes>>,
    ) -> Result<DirectResponse, DirectError> {
        loop {
            let (mut conn, reused) = match self.checkout(addr) {
                Some(conn) => (conn, true),
                None => (self.connect(addr).await?, false),
            };
            let pending = conn.tx.try_send_request(request);
            let mut pending = std::pin::pin!(pending);
            let sent = std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = pending.as_mut().poll(cx) {
                    return Poll::Ready(r);
                }
                // Write the request and read the head (or notice the connection closed),
                // then look at the response once more.
                conn.drive(cx);
                pending.as_mut().poll(cx)
            })
            .await;
            match sent {
                Ok(response) => {
                    let (parts, body) = response.into_parts();
                    return Ok(DirectResponse {
                        status: parts.status,
                        headers: parts.headers,
                        body: DirectBody {
                            body,
                            conn: Some(conn),
                            addr: addr.to_owned(),
                            pool: self.clone(),
                        },
                    });
                }
                Err(mut e) => match e.take_message() {
                    // A reused connection that closed before the request was written:
                    // the worker never saw it, so a fresh connection may carry it.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(e.into_error().into()),
                },
            }
        }
    }

    /// The most recently used idle connection to `addr` that is still open.
    fn checkout(&self, addr: &str) -> Option<Conn> {
        loop {
            let (IdleConn(mut conn), since) = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                idle.by_addr.get_mut(addr)?.pop()?
            };
            if since.elapsed() < self.idle_timeout && conn.usable() {
                return Some(conn);
            }
        }
    }

    /// Returns a connection whose response was read to the end.
    fn checkin(&self, addr: String, mut conn: Conn) {
        if !conn.usable() {
            return;
        }
        // One clock read per check-in, not one per idle connection (a busy worker has
        // dozens, and every leg checks one in).
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = self.idle_timeout;
        idle.sweep(timeout, now);
        let list = idle.by_addr.entry(addr).or_default();
        list.retain(|(_, since)| now.duration_since(*since) < timeout);
        if list.len() < MAX_IDLE_PER_WORKER {
            list.push((IdleConn(conn), now));
        }
    }

    async fn connect(&self, addr: &str) -> Result<Conn, DirectError> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Err(_) => return Err(DirectError::ConnectTimeout(addr.to_owned())),
                Ok(Err(source)) => {
                    return Err(DirectError::Connect {
                        addr: addr.to_owned(),
                        source,
                    })
                }
                Ok(Ok(stream)) => stream,
            };
        // Requests are single small writes; don't let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let (tx, conn) = http1::handshake(TokioIo::new(stream)).await?;
        Ok(Conn {
            tx,
            conn: Some(conn),
        })
    }
}

/// `host:port` of an `http://` URL (`None` for any other scheme).
pub fn authority(url: &reqwest::Url) -> Option<String> {
    if url.scheme() != "http" {
        return None;
    }
    // An IPv6 host comes bracketed, as an authority wants it.
    let host = url.host_str()?;
    let port = url.port_or_known_default()?;
    Some(format!("{host}:{port}"))
}

/// A response on a direct connection.
pub struct DirectResponse {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body, which drives the connection while it is read.
    pub body: DirectBody,
}

/// A response body that drives its connection as it is read, and returns the connection
/// to the pool once read to the end (dropped early, it closes the connection, which
/// cancels the worker's request).
pub struct DirectBody {
    body: Incoming,
    conn: Option<Conn>,
    addr: String,
    pool: DirectClient,
}

impl DirectBody {
    /// The whole body (one chunk without a copy, as a Content-Length body usually is).
    pub async fn concat(mut self) -> Result<Bytes, DirectError> {
        use futures::StreamExt;
        let Some(first) = self.next().await.transpose()? else {
            return Ok(Bytes::new());
        };
        let Some(second) = self.next().await.transpose()? else {
            return Ok(first);
        };
        let mut out = bytes::BytesMut::from(&first[..]);
        out.extend_from_slice(&second);
        while let Some(chunk) = self.next().await.transpose()? {
            out.extend_from_slice(&chunk);
        }
        Ok(out.freeze())
    }
}

impl Stream for DirectBody {
    type Item = Result<Bytes, DirectError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let mut drove = false;
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                    // Empty data or trailers: nothing to relay.
                    _ => continue,
                },
                Poll::Ready(Some(Err(e))) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(None) => {
                    if let Some(conn) = this.conn.take() {
                        this.pool.checkin(std::mem::take(&mut this.addr), conn);
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending if drove => return Poll::Pending,
                Poll::Pending => {
                    // Let the connection decode what it has read (or read more), then
                    // look at the body once more.
                    drove = true;
                    if let Some(conn) = this.conn.as_mut() {
                        conn.drive(cx);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{FutureExt, StreamExt};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    const EVENTS: [&str; 3] = [
        "data: {\"a\":1}\n\n",
        "data: {\"a\":2}\n\n",
        "data: [DONE]\n\n",
    ];

    /// A worker that answers every request with the SSE `EVENTS`, all in one write, each
    /// event its own HTTP chunk; closes the connection after `close_after` answers.
    async fn worker(close_after: usize) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    for _ in 0..close_after {
                        if !read_request(&mut socket).await {
                            return;
                        }
                        let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                        for event in EVENTS {
                            out.extend_from_slice(
                                format!("{:X}\r\n{event}\r\n", event.len()).as_bytes(),
                            );
                        }
                        out.extend_from_slice(b"0\r\n\r\n");
                        if socket.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    /// Reads one request (head and Content-Length body); false at EOF.
    async fn read_request(socket: &mut TcpStream) -> bool {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            match socket.read(&mut byte).await {
                Ok(1) => buf.push(byte[0]),
                _ => return false,
            }
        }
        let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0usize);
        let mut body = vec![0u8; len];
        socket.read_exact(&mut body).await.is_ok()
    }

    fn request(addr: &str) -> Request<Full<Bytes>> {
        Request::post("/v1/chat/completions")
            .header(http::header::HOST, addr)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    async fn events(client: &DirectClient, addr: &str) -> Vec<Bytes> {
        let response = client.send(addr, request(addr)).await.unwrap();
        assert_eq!(response.status, StatusCode::OK);
        response.body.map(|c| c.unwrap()).collect().await
    }

    #[tokio::test]
    async fn events_that_came_together_are_readable_without_waiting() {
        let (addr, _) = worker(1).await;
        let client = DirectClient::new(Duration::from_secs(5), Duration::from_secs(5));
        let mut body = client.send(&addr, request(&addr)).await.unwrap().body;
        // The first event may still be on its way; once it is here, the others (sent in
        // the same write) are decoded by polling the body alone: that is what lets the
        // relay answer a burst of events with one write.
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .unwrap();
        assert_eq!(first.unwrap().unwrap(), EVENTS[0]);
        for event in &EVENTS[1..] {
            let next = body.next().now_or_never().expect("already received");
            assert_eq!(next.unwrap().unwrap(), event);
        }
        assert!(body.next().now_or_never().expect("ended").is_none());
    }

    #[tokio::test]
    async fn reuses_an_open_connection_and_replaces_a_closed_one() {
        let client = DirectClient::new(Duration::from_secs(5), Duration::from_secs(5));
        let (addr, accepted) = worker(usize::MAX).await;
        for _ in 0..3 {
            assert_eq!(
                events(&client, &addr).await.concat(),
                EVENTS.concat().as_bytes()
            );
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one keep-alive connection"
        );

        // This worker closes each connection after one answer: the pooled connection is
        // found closed and the next request goes on a new one.
        let (addr, accepted) = worker(1).await;
        for _ in 0..3 {
            assert_eq!(
                events(&client, &addr).await.concat(),
                EVENTS.concat().as_bytes()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn idle_connections_of_a_worker_that_gets_no_more_requests_are_closed() {
        let client = DirectClient::new(Duration::from_millis(100), Duration::from_secs(5));
        let (gone, _) = worker(usize::MAX).await;
        let (stays, _) = worker(usize::MAX).await;
        events(&client, &gone).await;
        let pooled = |addr: &str| {
            let idle = client.idle.lock().unwrap();
            idle.by_addr.get(addr).map_or(0, Vec::len)
        };
        assert_eq!(pooled(&gone), 1);
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Only the other worker is used now; its check-in retires the expired one.
        events(&client, &stays).await;
        assert_eq!(pooled(&gone), 0);
        assert!(!client.idle.lock().unwrap().by_addr.contains_key(&gone));
        assert_eq!(pooled(&stays), 1);
    }

    #[tokio::test]
    async fn a_body_dropped_early_closes_its_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let closed = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut socket).await);
            let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
            socket.write_all(head).await.unwrap();
            // The client goes away: the worker sees the connection close.
            let mut rest = [0u8; 16];
            matches!(socket.read(&mut rest).await, Ok(0) | Err(_))
        });
        let client = DirectClient::new(Duration::from_secs(5), Duration::from_secs(5));
        let mut body = client.send(&addr, request(&addr)).await.unwrap().body;
        assert_eq!(body.next().await.unwrap().unwrap(), "hello");
        drop(body);
        let closed = tokio::time::timeout(Duration::from_secs(5), closed).await;
        assert!(closed.unwrap().unwrap());
        assert!(client.checkout(&addr).is_none(), "not returned to the pool");
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let client = DirectClient::new(Duration::from_secs(5), Duration::from_secs(5));
        let error = client.send(&addr, request(&addr)).await.err().unwrap();
        assert!(error.is_connect(), "{error}");
    }

    #[test]
    fn authority_of_http_urls_only() {
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        assert_eq!(
            authority(&url("http://127.0.0.1:8000/v1")).as_deref(),
            Some("127.0.0.1:8000")
        );
        assert_eq!(
            authority(&url("http://[::1]/v1")).as_deref(),
            Some("[::1]:80")
        );
        assert_eq!(authority(&url("https://127.0.0.1:8000/v1")), None);
    }
}
