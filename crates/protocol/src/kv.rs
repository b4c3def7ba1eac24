//! KV-handoff parameters: vLLM's `kv_transfer_params` and SGLang's bootstrap fields.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// vLLM's `kv_transfer_params` (NIXL-style pull), carried in requests and responses.
///
/// A prefill request sets `do_remote_decode`; the prefill response names where its
/// blocks live (`remote_*`); the decode request carries those back with
/// `do_remote_prefill`. Unknown fields (e.g. `tp_size`) are kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_block_ids: Option<RemoteBlockIds>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl KvTransferParams {
    /// The params a proxy sends to a prefill worker: "compute, keep the blocks, tell me where".
    pub fn prefill_request() -> Self {
        Self {
            do_remote_decode: true,
            ..Self::default()
        }
    }
}

/// Block ids as vLLM has sent them: a flat list (older releases) or one list per
/// KV-cache group (current releases).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RemoteBlockIds {
    Flat(Vec<u64>),
    Grouped(Vec<Vec<u64>>),
}

impl RemoteBlockIds {
    /// All block ids in order, across groups.
    pub fn flatten(&self) -> Vec<u64> {
        match self {
            Self::Flat(ids) => ids.clone(),
            Self::Grouped(groups) => groups.iter().flatten().copied().collect(),
        }
    }
}

/// SGLang's bootstrap fields, injected into both legs of a concurrent P/D handoff.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BootstrapParams {
    pub bootstrap_host: String,
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    pub bootstrap_room: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_unknown_fields_and_both_block_id_shapes() {
        let flat: KvTransferParams = serde_json::from_str(
            r#"{"do_remote_prefill":true,"remote_block_ids":[1,2],"tp_size":2}"#,
        )
        .unwrap();
        assert_eq!(
            flat.remote_block_ids,
            Some(RemoteBlockIds::Flat(vec![1, 2]))
        );
        assert_eq!(flat.extra["tp_size"], 2);
        let grouped: KvTransferParams =
            serde_json::from_str(r#"{"remote_block_ids":[[3,4],[5]]}"#).unwrap();
        assert_eq!(grouped.remote_block_ids.unwrap().flatten(), vec![3, 4, 5]);
        let out = serde_json::to_value(&flat).unwrap();
        assert_eq!(out["tp_size"], 2);
        assert_eq!(out["remote_host"], Value::Null);
    }
}
