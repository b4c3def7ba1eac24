//! The OpenAI-compatible gateway behind `pdserve gateway`.
//!
//! Clients speak the OpenAI API; the gateway routes each request across a live registry
//! of prefill, decode and prefill_decode workers (static flags, or registered at run time
//! through the admin API; health-probed, evicted and re-admitted), moving the KV cache
//! from prefill to decode with vLLM's `kv_transfer_params` protocol and reusing a
//! conversation's decode KV on its next turn. Requests with image, audio or video items
//! are encoded on encode workers first and reach prefill/decode as metadata references
//! (vLLM's E+P+D and E+PD).

pub mod access;
pub mod admin;
pub mod admission;
pub mod args;
pub mod auth;
pub mod conversation;
pub mod dashboard;
pub mod direct;
pub mod discovery;
pub mod encoder;
pub mod endpoint;
pub mod error;
pub mod handoff;
pub mod hops;
pub mod identity;
pub mod intake;
pub mod kv_events;
pub mod legs;
pub mod load;
pub mod metrics;
pub mod model_len;
pub mod policy;
pub mod prewarm;
pub mod profile;
pub mod prompt_tokens;
pub mod readiness;
pub mod registry;
pub mod request;
pub mod responses;
pub mod server;
pub mod state;
pub mod tokenize;
pub mod trace;
pub mod worker_client;

pub use args::{GatewayArgs, GatewayConfig};
pub use error::GatewayError;
pub use server::{router, serve};

/// Runs the gateway until SIGTERM or Ctrl-C, then drains open requests for up to
/// `--shutdown-timeout`.
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
        prefill_decode = config.worker.len(),
        encode = config.encode.len(),
        dynamic_registration = config.admin_api_key.is_some(),
        policy = %config.policy,
        prefill_policy = config.prefill_policy.as_deref().unwrap_or(&config.policy),
        decode_policy = config.decode_policy.as_deref().unwrap_or(&config.policy),
        "gateway listening"
    );
    if config.static_workers().next().is_none()
        && config.admin_api_key.is_none()
        && !config.discovery.any()
    {
        tracing::warn!(
            "no --prefill/--decode/--worker given, no discovery source and --dynamic-registration \
             is off: every request will get 503"
        );
    }
    serve(listener, config, async {
        shutdown_signal().await;
        tracing::info!("shutting down: no new connections; draining open requests");
    })
    .await
}

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
