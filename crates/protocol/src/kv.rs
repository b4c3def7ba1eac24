//! KV-handoff parameters: vLLM's `kv_transfer_params` and SGLang's bootstrap fields.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The request and response field that carries [`KvTransferParams`] (vLLM).
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The request and encoder-answer field that carries encoder-cache references (vLLM's
/// E+P+D: where a consumer finds an item's embedding).
pub const EC_TRANSFER_PARAMS: &str = "ec_transfer_params";

/// `kv_transfer_params` field of a prefill request (`do_remote_decode`) naming the id to
/// publish the prompt's KV under, chosen by the reader so it can start reading before
/// the prefill answers (concurrent handoff). pdserve's own extension; other workers
/// ignore it and publish under an id of their own.
pub const PUBLISH_REQUEST_ID: &str = "publish_request_id";

/// A pdserve worker's route that releases the KV blocks a prefill pinned for a decode
/// that will not come: `POST {"kv_transfer_params": ...}`.
pub const KV_RELEASE_PATH: &str = "/v1/kv/release";

/// The header that carries the KV transfer secret (`PDSERVE_KV_SECRET`) to
/// [`KV_RELEASE_PATH`].
pub const KV_SECRET_HEADER: &str = "x-pdserve-kv-secret";

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

/// Bootstrap rooms are below this (SGLang draws a `u64` and masks it to `i64::MAX`).
pub const BOOTSTRAP_ROOM_LIMIT: u64 = 1 << 63;

/// Which request body a bootstrap injection applies to: SGLang's router gives per-item
/// fields to a chat request with `n` > 1, a completion with a list of prompts, and a
/// native `/generate` batch (a list of texts or of token-id lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootstrapShape {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
    /// SGLang's native `/generate`.
    Generate,
}

impl BootstrapShape {
    /// How many items need a room of their own, or `None` for one scalar room.
    pub fn batch_size(self, body: &Map<String, Value>) -> Option<usize> {
        let list_len = |v: Option<&Value>| match v {
            Some(Value::Array(items)) if !items.is_empty() => Some(items.len()),
            _ => None,
        };
        match self {
            Self::Chat => body
                .get("n")
                .and_then(Value::as_u64)
                .filter(|&n| n > 1)
                .map(|n| n as usize),
            // A list of texts or of token-id lists is a batch; one token-id list is not.
            Self::Completion => match body.get("prompt") {
                Some(Value::Array(items)) if items.iter().all(|i| !i.is_number()) => {
                    list_len(body.get("prompt"))
                }
                _ => None,
            },
            Self::Generate => list_len(body.get("text")).or_else(|| match body.get("input_ids") {
                Some(Value::Array(items)) if items.iter().all(Value::is_array) => {
                    list_len(body.get("input_ids"))
                }
                _ => None,
            }),
        }
    }

    /// Writes `bootstrap_host`, `bootstrap_port` and `bootstrap_room` into `body` in
    /// SGLang's shapes: scalars, or (for a batch of `n`) three lists of `n` with a room
    /// per item. Rooms come from `room` (reduced below [`BOOTSTRAP_ROOM_LIMIT`]); returns
    /// them in item order.
    pub fn inject(
        self,
        body: &mut Map<String, Value>,
        host: &str,
        port: Option<u16>,
        mut room: impl FnMut() -> u64,
    ) -> Vec<u64> {
        let batch = self.batch_size(body);
        let rooms: Vec<u64> = (0..batch.unwrap_or(1))
            .map(|_| room() % BOOTSTRAP_ROOM_LIMIT)
            .collect();
        let port = port.map_or(Value::Null, Value::from);
        let (host, port, room) = match batch {
            None => (Value::from(host), port, Value::from(rooms[0])),
            Some(n) => (
                Value::Array(vec![Value::from(host); n]),
                Value::Array(vec![port; n]),
                Value::Array(rooms.iter().copied().map(Value::from).collect()),
            ),
        };
        body.insert("bootstrap_host".into(), host);
        body.insert("bootstrap_port".into(), port);
        body.insert("bootstrap_room".into(), room);
        rooms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn bootstrap_fields_follow_sglang_shapes() {
        let mut next = u64::MAX - 3;
        let mut room = || {
            next = next.wrapping_add(1);
            next
        };
        let mut chat = object(json!({"messages": [], "n": 1}));
        let rooms = BootstrapShape::Chat.inject(&mut chat, "127.0.0.1", Some(8998), &mut room);
        assert_eq!(rooms.len(), 1);
        assert!(rooms[0] < BOOTSTRAP_ROOM_LIMIT);
        assert_eq!(chat["bootstrap_host"], "127.0.0.1");
        assert_eq!(chat["bootstrap_port"], 8998);
        assert_eq!(chat["bootstrap_room"], rooms[0]);

        let mut chat = object(json!({"messages": [], "n": 3}));
        let rooms = BootstrapShape::Chat.inject(&mut chat, "127.0.0.1", None, &mut room);
        assert_eq!(chat["bootstrap_host"], json!(vec!["127.0.0.1"; 3]));
        assert_eq!(chat["bootstrap_port"], json!([null, null, null]));
        assert_eq!(chat["bootstrap_room"], json!(rooms));
        assert!(rooms.iter().all(|&r| r < BOOTSTRAP_ROOM_LIMIT));

        let cases = [
            (
                BootstrapShape::Completion,
                json!({"prompt": ["a", "b"]}),
                Some(2),
            ),
            (
                BootstrapShape::Completion,
                json!({"prompt": [[1], [2], [3]]}),
                Some(3),
            ),
            (
                BootstrapShape::Completion,
                json!({"prompt": [1, 2, 3]}),
                None,
            ),
            (
                BootstrapShape::Completion,
                json!({"prompt": "a", "n": 2}),
                None,
            ),
            (
                BootstrapShape::Generate,
                json!({"text": ["a", "b"]}),
                Some(2),
            ),
            (BootstrapShape::Generate, json!({"text": "a"}), None),
            (
                BootstrapShape::Generate,
                json!({"input_ids": [[1], [2]]}),
                Some(2),
            ),
            (BootstrapShape::Generate, json!({"input_ids": [1, 2]}), None),
        ];
        for (shape, body, batch) in cases {
            assert_eq!(shape.batch_size(&object(body.clone())), batch, "{body}");
        }
    }

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
