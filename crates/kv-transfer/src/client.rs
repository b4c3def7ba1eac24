//! The pulling side: reads a peer's pinned blocks.

use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::auth::TransferSecret;
use crate::error::TransferError;
use crate::frame::{read_frame, write_frame, FrameKind};
use crate::message::{ErrorMessage, ReadAccepted, ReadRequest, ReusedTokens, WireReadRequest};

/// Largest control frame (read header, error) accepted, in bytes.
const MAX_CONTROL_FRAME: usize = 64 << 10;

/// Limits of the pulling side.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// Longest wait to connect.
    pub connect_timeout: Duration,
    /// Longest wait for any one frame. A peer still computing the blocks sends each as
    /// it is computed and must keep every wait below this (pdserve engines do: see the
    /// README's "Blocks sent while they are computed").
    pub io_timeout: Duration,
    /// The shared transfer secret, sent with the read request.
    pub secret: Option<TransferSecret>,
}

impl Default for PullConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(10),
            secret: None,
        }
    }
}

/// Blocks received from a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct PulledBlocks {
    /// Leading tokens of the request's `token_ids` that the blocks hold.
    pub matched_tokens: usize,
    /// The blocks, in sequence order.
    pub blocks: Vec<Vec<u8>>,
    /// Of the matched tokens, those the peer's publishing request did not compute.
    pub reused: ReusedTokens,
    /// Payload bytes received.
    pub bytes: usize,
    /// Time from connect to the last block.
    pub elapsed: Duration,
    /// When the last block arrived (a peer still computing sends blocks as it goes, so
    /// this can be long after the read was accepted).
    pub received_at: Instant,
}

/// Pulls the blocks `request` names from the peer at `addr` (`host:port`); every block
/// must be `block_bytes` long. Confirms receipt so the peer frees them.
pub async fn pull(
    addr: &str,
    request: &ReadRequest,
    block_bytes: usize,
    config: &PullConfig,
) -> Result<PulledBlocks, TransferError> {
    let started = Instant::now();
    let mut stream = timeout(config.connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| TransferError::Timeout("connecting"))?
        .map_err(|source| TransferError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    let _ = stream.set_nodelay(true);
    let wire = WireReadRequest {
        request: std::borrow::Cow::Borrowed(request),
        secret: config.secret.as_ref().map(|s| s.expose().to_string()),
    };
    let json = serde_json::to_vec(&wire).map_err(|e| TransferError::Protocol(e.to_string()))?;
    timeout(
        config.io_timeout,
        write_frame(&mut stream, FrameKind::ReadRequest, &[&json]),
    )
    .await
    .map_err(|_| TransferError::Timeout("sending the read request"))??;

    let header = timeout(
        config.io_timeout,
        read_frame(&mut stream, MAX_CONTROL_FRAME),
    )
    .await
    .map_err(|_| TransferError::Timeout("waiting for the read header"))??;
    let accepted: ReadAccepted = match header.kind {
        FrameKind::ReadAccepted => serde_json::from_slice(&header.payload)
            .map_err(|e| TransferError::Protocol(format!("invalid read header: {e}")))?,
        FrameKind::Error => return Err(remote_error(&header.payload)),
        other => {
            return Err(TransferError::Protocol(format!(
                "expected a read header, got {other:?}"
            )))
        }
    };
    if accepted.block_bytes != block_bytes {
        return Err(TransferError::Protocol(format!(
            "peer sends blocks of {} bytes, expected {block_bytes}",
            accepted.block_bytes
        )));
    }
    if accepted.num_blocks > request.block_ids.len() {
        return Err(TransferError::Protocol(format!(
            "peer announced {} blocks for a read of {}",
            accepted.num_blocks,
            request.block_ids.len()
        )));
    }
    if accepted.matched_tokens > request.token_ids.len() {
        return Err(TransferError::Protocol(format!(
            "peer claims {} matched tokens of {}",
            accepted.matched_tokens,
            request.token_ids.len()
        )));
    }

    let mut blocks = Vec::with_capacity(accepted.num_blocks);
    // An error frame may come instead of any block (a server still computing them
    // failed): room for its message even where blocks are small.
    let max_frame = (block_bytes + 4).max(MAX_CONTROL_FRAME);
    for expected in 0..accepted.num_blocks {
        let frame = timeout(config.io_timeout, read_frame(&mut stream, max_frame))
            .await
            .map_err(|_| TransferError::Timeout("receiving a block"))??;
        match frame.kind {
            FrameKind::Block => {}
            FrameKind::Error => return Err(remote_error(&frame.payload)),
            other => {
                return Err(TransferError::Protocol(format!(
                    "expected a block, got {other:?}"
                )))
            }
        }
        if frame.payload.len() != block_bytes + 4 {
            return Err(TransferError::Protocol(format!(
                "block {expected} has {} bytes, expected {block_bytes}",
                frame.payload.len().saturating_sub(4)
            )));
        }
        let index = u32::from_le_bytes([
            frame.payload[0],
            frame.payload[1],
            frame.payload[2],
            frame.payload[3],
        ]);
        if index as usize != expected {
            return Err(TransferError::Protocol(format!(
                "block {index} arrived where block {expected} was expected"
            )));
        }
        let mut payload = frame.payload;
        payload.drain(..4);
        blocks.push(payload);
    }
    let received_at = Instant::now();
    let elapsed = received_at - started;
    timeout(
        config.io_timeout,
        write_frame(&mut stream, FrameKind::ReadComplete, &[]),
    )
    .await
    .map_err(|_| TransferError::Timeout("confirming the read"))??;
    let _ = stream.shutdown().await;
    Ok(PulledBlocks {
        matched_tokens: accepted.matched_tokens,
        reused: accepted.reused.within(accepted.matched_tokens),
        bytes: blocks.len() * block_bytes,
        blocks,
        elapsed,
        received_at,
    })
}

fn remote_error(payload: &[u8]) -> TransferError {
    match serde_json::from_slice::<ErrorMessage>(payload) {
        Ok(m) => TransferError::Remote {
            code: m.code,
            message: m.message,
        },
        Err(e) => TransferError::Protocol(format!("invalid error frame: {e}")),
    }
}
