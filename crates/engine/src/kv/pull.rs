//! Pulling a peer's published KV blocks, named by `kv_transfer_params`, with bounded
//! waits.

use std::time::Duration;

use pdserve_kv_transfer::{pull, ErrorCode, PullConfig, PulledBlocks, ReadRequest, TransferError};
use pdserve_protocol::KvTransferParams;

use super::{HandoffError, KvContext};

/// Longest wait to connect to a peer's KV service.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for any one frame from a peer. Generous: the peer copies blocks out
/// between its scheduler steps, and one step of a long prompt chunk on a loaded CPU can
/// take seconds.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The peer and read a set of `kv_transfer_params` name.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteBlocks {
    /// The peer's host (`remote_host`), checked against `--kv-peers`.
    pub host: String,
    /// `host:port` of the peer's KV service.
    pub addr: String,
    /// What to ask the peer for (`token_ids` still empty).
    pub read: ReadRequest,
}

impl RemoteBlocks {
    /// The remote side of `params`, or the first field missing from them.
    pub fn from_params(params: &KvTransferParams, layout: &str) -> Result<Self, HandoffError> {
        let missing = HandoffError::MissingField;
        let host = params
            .remote_host
            .as_deref()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| missing("remote_host"))?;
        let port = params.remote_port.ok_or_else(|| missing("remote_port"))?;
        let engine_id = params
            .remote_engine_id
            .clone()
            .ok_or_else(|| missing("remote_engine_id"))?;
        let request_id = params
            .remote_request_id
            .clone()
            .ok_or_else(|| missing("remote_request_id"))?;
        let block_ids = params
            .remote_block_ids
            .as_ref()
            .ok_or_else(|| missing("remote_block_ids"))?
            .flatten();
        Ok(Self {
            host: host.to_string(),
            addr: socket_addr(host, port),
            read: ReadRequest {
                engine_id,
                request_id,
                block_ids,
                token_ids: Vec::new(),
                layout: layout.to_string(),
                traceparent: None,
                tracestate: None,
            },
        })
    }

    /// A read that waits for `peer` to publish a prompt of `prompt_tokens` tokens under
    /// `request_id`, an id this worker chose (see [`super::service::awaited`]).
    pub fn awaited(peer: &KvPeer, request_id: String, prompt_tokens: usize, layout: &str) -> Self {
        Self {
            host: peer.host.clone(),
            addr: socket_addr(&peer.host, peer.port),
            read: ReadRequest {
                engine_id: peer.engine_id.clone(),
                request_id,
                block_ids: super::service::awaited::awaited_block_ids(prompt_tokens),
                token_ids: Vec::new(),
                layout: layout.to_string(),
                traceparent: None,
                tracestate: None,
            },
        }
    }

    /// Whether `params` name a peer's blocks at all (a fresh prefill request has them
    /// all null).
    pub fn named_by(params: &KvTransferParams) -> bool {
        params.remote_host.is_some()
            || params.remote_port.is_some()
            || params.remote_block_ids.is_some()
            || params.remote_request_id.is_some()
    }
}

/// A peer's KV transfer service, as its `kv_transfer_params` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPeer {
    /// `remote_host`.
    pub host: String,
    /// `remote_port`.
    pub port: u16,
    /// `remote_engine_id`.
    pub engine_id: String,
}

impl KvPeer {
    /// The peer `params` name, if they name one completely.
    pub fn from_params(params: &KvTransferParams) -> Option<Self> {
        Some(Self {
            host: params.remote_host.clone().filter(|h| !h.is_empty())?,
            port: params.remote_port?,
            engine_id: params.remote_engine_id.clone()?,
        })
    }
}

/// `host:port`, bracketing IPv6 literals.
fn socket_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Reads the blocks `remote` names, for `token_ids`; the peer frees them afterwards.
/// A host outside `--kv-peers` is refused before anything is dialled.
pub async fn pull_blocks(
    kv: &KvContext,
    mut remote: RemoteBlocks,
    token_ids: &[u32],
) -> Result<PulledBlocks, HandoffError> {
    if !kv.peers.allows_dialling(&remote.host).await {
        kv.metrics.kv.peers_refused.inc();
        tracing::warn!(host = %remote.host, "refused to read KV from a host not in --kv-peers");
        return Err(HandoffError::PeerNotAllowed { host: remote.host });
    }
    remote.read.token_ids = token_ids.to_vec();
    let span = crate::trace::pull_span(&mut remote.read, &remote.addr);
    let config = PullConfig {
        connect_timeout: CONNECT_TIMEOUT,
        io_timeout: IO_TIMEOUT,
        secret: kv.secret.clone(),
    };
    let counters = &kv.metrics.kv;
    let mut result = pull(&remote.addr, &remote.read, kv.block_bytes, &config).await;
    if let (Ok(pulled), Some(link)) = (&mut result, &kv.link) {
        // The blocks came over the loopback; the simulated link is slower.
        let modelled = link.transfer_time(pulled.matched_tokens);
        tokio::time::sleep(modelled).await;
        pulled.elapsed += modelled;
        pulled.received_at = std::time::Instant::now();
    }
    if let Some(span) = span {
        use pdserve_telemetry::semconv as sc;
        use pdserve_telemetry::KeyValue;
        match &result {
            Ok(pulled) => {
                span.set(KeyValue::new(
                    sc::PDSERVE_KV_BLOCKS,
                    pulled.blocks.len() as i64,
                ));
                span.set(KeyValue::new(sc::PDSERVE_KV_BYTES, pulled.bytes as i64));
                span.set(KeyValue::new(
                    sc::PDSERVE_KV_TOKENS,
                    pulled.matched_tokens as i64,
                ));
                span.set(KeyValue::new(
                    sc::PDSERVE_KV_SECONDS,
                    pulled.elapsed.as_secs_f64(),
                ));
            }
            Err(e) => span.fail(e.to_string()),
        }
    }
    match result {
        Ok(pulled) => {
            counters.blocks_received.inc_by(pulled.blocks.len() as u64);
            counters.bytes_received.inc_by(pulled.bytes as u64);
            counters
                .transfer_seconds
                .observe(pulled.elapsed.as_secs_f64());
            tracing::debug!(
                addr = %remote.addr,
                blocks = pulled.blocks.len(),
                matched_tokens = pulled.matched_tokens,
                ms = pulled.elapsed.as_secs_f64() * 1e3,
                "KV blocks received"
            );
            Ok(pulled)
        }
        Err(e) => {
            counters.pull_failures.inc();
            match &e {
                TransferError::Remote {
                    code: ErrorCode::Unauthorized | ErrorCode::PeerNotAllowed,
                    ..
                } => tracing::error!(
                    addr = %remote.addr,
                    error = %e,
                    "KV peer refused this worker: PDSERVE_KV_SECRET or --kv-peers differ between the workers"
                ),
                TransferError::Remote {
                    code: ErrorCode::Gone,
                    ..
                } => {
                    counters.handback_gone.inc();
                    tracing::info!(addr = %remote.addr, "the KV peer reclaimed the blocks already");
                }
                _ => tracing::warn!(addr = %remote.addr, error = %e, "KV pull failed"),
            }
            Err(HandoffError::pull(&remote.addr, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_protocol::RemoteBlockIds;

    #[test]
    fn params_name_the_peer_or_a_missing_field() {
        let mut params = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("e".into()),
            remote_block_ids: Some(RemoteBlockIds::Grouped(vec![vec![4, 5]])),
            remote_host: Some("::1".into()),
            remote_port: Some(9),
            remote_request_id: Some("r".into()),
            ..Default::default()
        };
        let remote = RemoteBlocks::from_params(&params, "L").unwrap();
        assert_eq!(remote.addr, "[::1]:9");
        assert_eq!(remote.read.block_ids, vec![4, 5]);
        assert_eq!(remote.read.layout, "L");
        params.remote_request_id = None;
        let err = RemoteBlocks::from_params(&params, "L").unwrap_err();
        assert!(
            matches!(err, HandoffError::MissingField("remote_request_id")),
            "{err}"
        );
        assert!(RemoteBlocks::named_by(&params));
        assert!(!RemoteBlocks::named_by(&KvTransferParams::prefill_request()));
    }
}
