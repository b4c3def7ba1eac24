//! The OpenAI-compatible gateway behind `pdserve gateway`.

/// `pdserve gateway` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {}

/// Errors that stop a gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    Other(String),
}

/// Runs the gateway until Ctrl-C.
pub async fn run(_args: GatewayArgs) -> Result<(), GatewayError> {
    Err(GatewayError::Other("the gateway is not built yet".into()))
}
