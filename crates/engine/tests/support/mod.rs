//! The one harness of the engine's test binaries: workers over real HTTP on 127.0.0.1:0
//! with the real default model (SmolLM2-135M Q4_1, fetched with pip on first use), the
//! lock that runs their tests one at a time, and the request bodies they send. A test
//! binary takes it with `mod support;`.

// Each test binary compiles the whole harness and uses a part of it.
#![allow(dead_code)]

pub mod bootstrap;
pub mod kv;
mod requests;
mod worker;

use std::time::Duration;

// Not every binary uses every re-export either.
#[allow(unused_imports)]
pub use requests::{chat, completion, text_of};
pub use worker::TestWorker;

/// Bounds every test, model loads included (2 slow CI cores).
pub const TEST_DEADLINE: Duration = Duration::from_secs(300);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `body` alone in its test binary, bounded in time: each test starts its own
/// workers (two at once would fight over 2 CI cores) and metrics assertions must not see
/// another test's traffic.
pub async fn serial<F: std::future::Future<Output = ()>>(body: F) {
    let _guard = SERIAL.lock().await;
    tokio::time::timeout(TEST_DEADLINE, body)
        .await
        .expect("test finished within its deadline");
}
