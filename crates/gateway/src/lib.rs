//! The OpenAI-compatible gateway behind `pdserve gateway`.
//!
//! Clients speak the OpenAI API; the gateway routes each request across static pools of
//! prefill, decode and aggregated workers, moving the KV cache from prefill to decode
//! with vLLM's `kv_transfer_params` protocol and reusing a conversation's decode KV on
//! its next turn.

pub mod args;
pub mod conversation;
pub mod error;
pub mod handoff;
pub mod metrics;
pub mod registry;
pub mod server;
pub mod upstream;
pub mod validation;

pub use args::{GatewayArgs, GatewayConfig};
pub use error::GatewayError;
pub use server::{router, serve};

/// Runs the gateway until Ctrl-C, then drains open requests.
pub async fn run(args: GatewayArgs) -> Result<(), GatewayError> {
    let config = args.to_config()?;
    let addr = args.listen_addr();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr()?;
    tracing::info!(
        addr = %local,
        prefill = config.prefill.len(),
        decode = config.decode.len(),
        worker = config.worker.len(),
        "gateway listening"
    );
    if config.prefill.is_empty() && config.decode.is_empty() && config.worker.is_empty() {
        tracing::warn!("no --prefill/--decode/--worker given: every request will get 503");
    }
    serve(listener, config, async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
        tracing::info!("shutting down: draining open requests");
    })
    .await
}
