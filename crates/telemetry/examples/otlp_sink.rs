//! A minimal OTLP/HTTP trace sink for measuring tracing's overhead without a collector:
//! accepts `POST /v1/traces` (protobuf) on 127.0.0.1, decodes each export and prints the
//! spans and bytes received every 5 seconds.
//!
//! ```sh
//! cargo run --release -p pdserve-telemetry --example otlp_sink -- 4318 &
//! pdserve up --otlp-traces-endpoint http://127.0.0.1:4318
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;

#[derive(Default)]
struct Counts {
    exports: AtomicU64,
    spans: AtomicU64,
    bytes: AtomicU64,
    malformed: AtomicU64,
}

async fn receive(State(counts): State<Arc<Counts>>, body: Bytes) -> &'static str {
    counts.exports.fetch_add(1, Ordering::Relaxed);
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            let spans: usize = request
                .resource_spans
                .iter()
                .flat_map(|r| &r.scope_spans)
                .map(|s| s.spans.len())
                .sum();
            counts.spans.fetch_add(spans as u64, Ordering::Relaxed);
        }
        Err(_) => {
            counts.malformed.fetch_add(1, Ordering::Relaxed);
        }
    }
    ""
}

#[tokio::main]
async fn main() {
    let port: u16 = std::env::args()
        .nth(1)
        .map(|p| p.parse().expect("the port, a number"))
        .unwrap_or(4318);
    let counts = Arc::new(Counts::default());
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(counts.clone());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("cannot bind the port");
    println!("OTLP/HTTP sink at http://127.0.0.1:{port}/v1/traces");
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        tick.tick().await;
        loop {
            tick.tick().await;
            println!(
                "exports {} spans {} bytes {} malformed {}",
                counts.exports.load(Ordering::Relaxed),
                counts.spans.load(Ordering::Relaxed),
                counts.bytes.load(Ordering::Relaxed),
                counts.malformed.load(Ordering::Relaxed)
            );
        }
    });
    axum::serve(listener, app).await.expect("the sink failed");
}
