//! The serving side: answers reads of pinned blocks from a [`BlockSource`].

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

use crate::auth::TransferSecret;
use crate::error::TransferError;
use crate::frame::{read_frame, write_frame, FrameKind};
use crate::message::{
    ErrorCode, ErrorMessage, ReadAccepted, ReadRequest, ReusedTokens, WireReadRequest,
};
use crate::peers::PeerAllowList;
use crate::pending::Pending;

/// Blocks copied out for one read.
#[derive(Debug)]
pub struct Export {
    /// Leading tokens of the request's `token_ids` that the blocks hold.
    pub matched_tokens: usize,
    /// The blocks ready now, in sequence order, each `block_bytes` long.
    pub blocks: Vec<Vec<u8>>,
    /// Of the matched tokens, those the publishing request did not compute itself.
    pub reused: ReusedTokens,
    /// Blocks that follow `blocks` but are still being computed, sent as they come
    /// (`None`: every block is ready).
    pub pending: Option<Pending>,
}

impl Export {
    /// An export whose blocks are all ready.
    pub fn ready(matched_tokens: usize, blocks: Vec<Vec<u8>>, reused: ReusedTokens) -> Self {
        Self {
            matched_tokens,
            blocks,
            reused,
            pending: None,
        }
    }

    /// Blocks the read announces: the ready ones and the pending ones.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len() + self.pending.as_ref().map_or(0, |p| p.count)
    }
}

/// How an accepted read ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadOutcome {
    /// The client confirmed it received every block.
    Completed,
    /// The read broke off after it was accepted; the client cannot use the blocks.
    Failed(String),
}

/// What one accepted read moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    pub blocks: usize,
    pub bytes: usize,
    pub elapsed: Duration,
}

/// Whatever holds pinned blocks: an engine.
pub trait BlockSource: Send + Sync + 'static {
    /// This engine's id (`remote_engine_id` in `kv_transfer_params`).
    fn engine_id(&self) -> &str;
    /// A description of the block format (model shape and precision); a peer with
    /// another layout is refused.
    fn layout(&self) -> &str;
    /// Bytes in one block.
    fn block_bytes(&self) -> usize;
    /// Checks `request` against what is pinned for it and copies those blocks out; blocks
    /// still being computed go in [`Export::pending`] and are sent as they come.
    fn export(
        &self,
        request: &ReadRequest,
    ) -> impl Future<Output = Result<Export, (ErrorCode, String)>> + Send;
    /// Called exactly once for every read that `export` accepted, when it ends.
    fn finish(&self, request_id: &str, outcome: ReadOutcome, stats: TransferStats);
}

/// Limits of the serving side.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Longest wait for any one frame to be read or written.
    pub io_timeout: Duration,
    /// Largest read request accepted, in bytes.
    pub max_request_bytes: usize,
    /// Most blocks one read may name.
    pub max_blocks: usize,
    /// Most connections served at once.
    pub max_connections: usize,
    /// Addresses served (`None`: any). Others get a `peer_not_allowed` error.
    pub peers: Option<Arc<PeerAllowList>>,
    /// The secret every read request must carry (`None`: none asked).
    pub secret: Option<TransferSecret>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            io_timeout: Duration::from_secs(10),
            max_request_bytes: 4 << 20,
            max_blocks: 16_384,
            max_connections: 64,
            peers: None,
            secret: None,
        }
    }
}

/// Serves reads on `listener` until `shutdown` completes.
pub async fn serve<S: BlockSource>(
    listener: TcpListener,
    source: Arc<S>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(config.max_connections));
    let config = Arc::new(config);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "KV transfer accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "KV transfer connection refused: too many connections");
            continue;
        };
        let source = source.clone();
        let config = config.clone();
        tokio::spawn(async move {
            if let Err(e) = handle_connection(stream, peer.ip(), &*source, &config).await {
                tracing::debug!(%peer, error = %e, "KV transfer connection ended with an error");
            }
            drop(permit);
        });
    }
}

async fn handle_connection<S: BlockSource>(
    mut stream: TcpStream,
    peer: IpAddr,
    source: &S,
    config: &ServerConfig,
) -> Result<(), TransferError> {
    let _ = stream.set_nodelay(true);
    let frame = timeout(
        config.io_timeout,
        read_frame(&mut stream, config.max_request_bytes),
    )
    .await
    .map_err(|_| TransferError::Timeout("waiting for a read request"))??;
    // The request was read (bounded) before answering so the client sees the refusal
    // rather than a reset; it is not looked at.
    if let Some(peers) = &config.peers {
        if !peers.allows_addr(peer).await {
            tracing::warn!(%peer, "KV transfer connection refused: not in --kv-peers");
            let message = format!("{peer} is not an allowed KV peer of this worker");
            return refuse(&mut stream, ErrorCode::PeerNotAllowed, message, config).await;
        }
    }
    let request = match parse_request(frame.kind, &frame.payload, source, config) {
        Ok(r) => r,
        Err((code, message)) => {
            if code == ErrorCode::Unauthorized {
                tracing::warn!(%peer, "KV read refused: {message}");
            }
            return refuse(&mut stream, code, message, config).await;
        }
    };
    let started = Instant::now();
    let export = match source.export(&request).await {
        Ok(e) => e,
        Err((code, message)) => return refuse(&mut stream, code, message, config).await,
    };
    let stats = TransferStats {
        blocks: export.num_blocks(),
        bytes: export.num_blocks() * source.block_bytes(),
        elapsed: Duration::ZERO,
    };
    let result = send_blocks(&mut stream, export, source.block_bytes(), config).await;
    let stats = TransferStats {
        elapsed: started.elapsed(),
        ..stats
    };
    match &result {
        Ok(()) => source.finish(&request.request_id, ReadOutcome::Completed, stats),
        Err(e) => source.finish(
            &request.request_id,
            ReadOutcome::Failed(e.to_string()),
            stats,
        ),
    }
    result
}

fn parse_request<S: BlockSource>(
    kind: FrameKind,
    payload: &[u8],
    source: &S,
    config: &ServerConfig,
) -> Result<ReadRequest, (ErrorCode, String)> {
    if kind != FrameKind::ReadRequest {
        return Err((
            ErrorCode::BadRequest,
            format!("expected a read request, got {kind:?}"),
        ));
    }
    let wire: WireReadRequest<'static> = serde_json::from_slice(payload)
        .map_err(|e| (ErrorCode::BadRequest, format!("invalid read request: {e}")))?;
    if let Some(secret) = &config.secret {
        if !secret.verify(wire.secret.as_deref()) {
            let why = if wire.secret.is_some() {
                "the read request's transfer secret is wrong"
            } else {
                "the read request carries no transfer secret"
            };
            return Err((
                ErrorCode::Unauthorized,
                format!("{why} (PDSERVE_KV_SECRET must be the same on every worker)"),
            ));
        }
    }
    let request = wire.request.into_owned();
    if request.engine_id != source.engine_id() {
        return Err((
            ErrorCode::WrongEngine,
            format!(
                "this is engine {}, not {}",
                source.engine_id(),
                request.engine_id
            ),
        ));
    }
    if request.layout != source.layout() {
        return Err((
            ErrorCode::LayoutMismatch,
            format!(
                "block layout {} differs from this engine's {}",
                request.layout,
                source.layout()
            ),
        ));
    }
    if request.block_ids.len() > config.max_blocks {
        return Err((
            ErrorCode::BadRequest,
            format!(
                "{} blocks requested, at most {} allowed",
                request.block_ids.len(),
                config.max_blocks
            ),
        ));
    }
    Ok(request)
}

async fn send_blocks(
    stream: &mut TcpStream,
    export: Export,
    block_bytes: usize,
    config: &ServerConfig,
) -> Result<(), TransferError> {
    let accepted = ReadAccepted {
        matched_tokens: export.matched_tokens,
        num_blocks: export.num_blocks(),
        block_bytes,
        reused: export.reused.within(export.matched_tokens),
    };
    let json = serde_json::to_vec(&accepted).map_err(|e| TransferError::Protocol(e.to_string()))?;
    timeout(
        config.io_timeout,
        write_frame(stream, FrameKind::ReadAccepted, &[&json]),
    )
    .await
    .map_err(|_| TransferError::Timeout("sending the read header"))??;
    for (index, block) in export.blocks.iter().enumerate() {
        send_block(stream, index, block, config).await?;
    }
    if let Some(mut pending) = export.pending {
        for index in export.blocks.len()..export.blocks.len() + pending.count {
            // No frame timeout while the block is computed (the source bounds that
            // wait), but a reader that hangs up meanwhile ends the read at once.
            let block = tokio::select! {
                biased;
                block = pending.blocks.next_block() => block,
                gone = reader_gone(stream) => return Err(gone),
            };
            match block {
                Ok(block) if block.len() == block_bytes => {
                    send_block(stream, index, &block, config).await?
                }
                Ok(block) => {
                    let message = format!(
                        "block {index} has {} bytes, expected {block_bytes}",
                        block.len()
                    );
                    return refuse(stream, ErrorCode::Internal, message, config).await;
                }
                Err((code, message)) => return refuse(stream, code, message, config).await,
            }
        }
    }
    stream.flush().await?;
    let ack = timeout(config.io_timeout, read_frame(stream, 0))
        .await
        .map_err(|_| TransferError::Timeout("waiting for the read to be confirmed"))??;
    if ack.kind != FrameKind::ReadComplete {
        return Err(TransferError::Protocol(format!(
            "expected read-complete, got {:?}",
            ack.kind
        )));
    }
    Ok(())
}

async fn send_block(
    stream: &mut TcpStream,
    index: usize,
    block: &[u8],
    config: &ServerConfig,
) -> Result<(), TransferError> {
    let index = (index as u32).to_le_bytes();
    timeout(
        config.io_timeout,
        write_frame(stream, FrameKind::Block, &[&index, block]),
    )
    .await
    .map_err(|_| TransferError::Timeout("sending a block"))?
}

/// Resolves when the reader closed its side or spoke before every block was sent (it
/// only ever sends `ReadComplete` after the last one); pending otherwise.
async fn reader_gone(stream: &TcpStream) -> TransferError {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte).await {
        Ok(0) => TransferError::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the reader hung up before every block was sent",
        )),
        Ok(_) => TransferError::Protocol("the reader spoke before every block was sent".into()),
        Err(e) => TransferError::Io(e),
    }
}

async fn refuse(
    stream: &mut TcpStream,
    code: ErrorCode,
    message: String,
    config: &ServerConfig,
) -> Result<(), TransferError> {
    let body = serde_json::to_vec(&ErrorMessage {
        code,
        message: message.clone(),
    })
    .map_err(|e| TransferError::Protocol(e.to_string()))?;
    let _ = timeout(
        config.io_timeout,
        write_frame(stream, FrameKind::Error, &[&body]),
    )
    .await;
    let _ = stream.shutdown().await;
    Err(TransferError::Remote { code, message })
}
