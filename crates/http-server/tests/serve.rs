//! The shared accept loop against raw TCP clients: half a head, half a body, the
//! connection cap, and the graceful drain.

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use pdserve_http_server::{is_body_read_timeout, serve, ServeOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Reads the body; any failure is a 400 here (the server makes a timeout 408).
async fn read_body(body: Body) -> (StatusCode, String) {
    match axum::body::to_bytes(body, usize::MAX).await {
        Ok(bytes) => (StatusCode::OK, format!("{} bytes", bytes.len())),
        Err(e) => {
            assert!(is_body_read_timeout(&e), "{e}");
            (StatusCode::BAD_REQUEST, e.to_string())
        }
    }
}

fn app() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/body", post(read_body))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "slow"
            }),
        )
}

struct Server {
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(options: ServeOptions) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, app(), options, async {
            let _ = stopped.await;
        }));
        Self {
            addr,
            stop: Some(stop),
            task,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn options(header: u64, body: u64, max_connections: usize) -> ServeOptions {
    ServeOptions {
        header_read_timeout: Duration::from_millis(header),
        body_read_timeout: Duration::from_millis(body),
        max_connections,
    }
}

/// Everything the server sends until it closes the connection.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("the server kept the connection open");
    String::from_utf8_lossy(&out).into_owned()
}

/// One response's bytes (the test routes answer with short, Content-Length bodies).
async fn read_response(stream: &mut TcpStream) -> String {
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test]
async fn half_a_head_is_cut_off_at_the_header_read_timeout() {
    let server = Server::start(options(200, 10_000, 0)).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        .await
        .unwrap();
    let answer = read_to_close(&mut stream).await;
    assert!(!answer.contains("200 OK"), "{answer}");
}

#[tokio::test]
async fn half_a_body_gets_408_and_the_connection_closes() {
    let server = Server::start(options(10_000, 200, 0)).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(
            b"POST /body HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789",
        )
        .await
        .unwrap();
    let answer = read_to_close(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains(r#""code":"request_timeout""#), "{answer}");
    assert!(answer.contains("not received within"), "{answer}");
}

#[tokio::test]
async fn a_whole_body_within_the_limit_is_read() {
    let server = Server::start(options(10_000, 10_000, 0)).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"POST /body HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\nabcd")
        .await
        .unwrap();
    let answer = read_response(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("4 bytes"), "{answer}");
}

#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let server = Server::start(options(10_000, 10_000, 1)).await;
    let request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let mut first = TcpStream::connect(server.addr).await.unwrap();
    first.write_all(request).await.unwrap();
    assert!(read_response(&mut first).await.starts_with("HTTP/1.1 200"));
    // The first connection is open (keep-alive): the second waits in the backlog.
    let mut second = TcpStream::connect(server.addr).await.unwrap();
    second.write_all(request).await.unwrap();
    let mut buf = [0u8; 64];
    let waited = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buf)).await;
    assert!(waited.is_err(), "a connection over the cap was served");
    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(10), read_response(&mut second))
        .await
        .expect("the waiting connection was never served");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn shutdown_lets_open_requests_finish_and_refuses_new_connections() {
    let mut server = Server::start(options(10_000, 10_000, 0)).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.stop.take().unwrap().send(()).unwrap();
    let answer = read_to_close(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("slow"), "{answer}");
    tokio::time::timeout(Duration::from_secs(10), &mut server.task)
        .await
        .expect("serve did not return after the drain")
        .unwrap();
    assert!(TcpStream::connect(server.addr).await.is_err());
}
