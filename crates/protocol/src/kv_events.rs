//! KV-cache events in vLLM's wire format (`vllm/distributed/kv_events.py`): what an
//! engine tells routers about the blocks in its prefix cache.
//!
//! On the wire (ZeroMQ PUB) every message has three frames: the topic, the sequence
//! number as 8 big-endian bytes, and a msgpack `KVEventBatch`. The envelope is an array
//! (`EventBatch` is `array_like` in vLLM 0.32: `[ts, [events], dp_rank]`, the rank left
//! out when there is none) whose events are maps tagged by `type` (`{"type":
//! "BlockStored", "block_hashes": […], …}`); earlier releases and other publishers wrote
//! the envelope as a map, or the events as arrays (`["BlockStored", [hashes], parent,
//! [tokens], block_size, lora_id, medium]`). [`encode`] writes vLLM 0.32's shape;
//! [`decode`] reads every one, and block hashes given as integers (older vLLM, SGLang) or
//! bytes (vLLM's sha256 hashes).

use std::fmt;

use rmpv::Value;
use serde::Serialize;

mod reader;

/// The 8-byte sequence number a replay answer ends with.
pub const END_OF_REPLAY: i64 = -1;

/// An engine's identity for a block: an integer, or the bytes of a digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineBlockHash {
    /// An integer hash (pdserve, SGLang, vLLM before sha256 hashing); negative Python
    /// hashes are kept as their two's complement.
    Int(u64),
    /// A digest (vLLM's sha256 block hashes).
    Bytes(Vec<u8>),
}

impl Serialize for EngineBlockHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Int(v) => s.serialize_u64(*v),
            Self::Bytes(b) => s.serialize_bytes(b),
        }
    }
}

/// One change to an engine's prefix cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum KvCacheEvent {
    /// Blocks entered the prefix cache: `block_hashes` are consecutive, the first
    /// following `parent_block_hash`, and `token_ids` holds all their tokens in order.
    BlockStored {
        /// The stored blocks' hashes, in sequence order.
        block_hashes: Vec<EngineBlockHash>,
        /// The hash of the block before the first one (`None`: the sequence's start).
        parent_block_hash: Option<EngineBlockHash>,
        /// `block_size` tokens per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Deprecated LoRA id (vLLM keeps it for compatibility).
        lora_id: Option<i64>,
        /// Where the blocks live (vLLM: `"GPU"`, `"CPU"` for offloaded blocks).
        medium: Option<String>,
        /// The LoRA adapter the blocks were computed with.
        lora_name: Option<String>,
    },
    /// Blocks left the prefix cache.
    BlockRemoved {
        /// The removed blocks' hashes.
        block_hashes: Vec<EngineBlockHash>,
        /// Where they lived.
        medium: Option<String>,
    },
    /// The engine's whole prefix cache was emptied (also sent when it starts).
    AllBlocksCleared,
}

/// One published message's payload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvEventBatch {
    /// When the batch was made (seconds since the Unix epoch).
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvCacheEvent>,
    /// The data-parallel rank that published it.
    pub data_parallel_rank: Option<u32>,
}

/// A decoded batch and what in it could not be read.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The batch, with the events that could be read.
    pub batch: KvEventBatch,
    /// Events left out, and why (unknown tags, wrong shapes).
    pub skipped: Vec<String>,
}

/// Why a payload is not a `KVEventBatch` at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a KV event batch: {0}")]
pub struct DecodeError(pub String);

/// The msgpack payload of `batch`, as vLLM 0.32 publishes it: `[ts, events, rank]` (no
/// rank: `[ts, events]`, as msgspec's `omit_defaults` writes it), each event a map.
pub fn encode(batch: &KvEventBatch) -> Vec<u8> {
    let encoded = match batch.data_parallel_rank {
        Some(rank) => rmp_serde::to_vec_named(&(batch.ts, &batch.events, rank)),
        None => rmp_serde::to_vec_named(&(batch.ts, &batch.events)),
    };
    encoded.expect("event batches always encode")
}

/// Reads a payload in either of vLLM's shapes. A batch whose envelope is wrong is an
/// error; an event inside it that cannot be read is skipped and reported.
pub fn decode(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    match reader::read_batch(payload) {
        Some(batch) => Ok(DecodedBatch {
            batch,
            skipped: Vec::new(),
        }),
        None => decode_values(payload),
    }
}

/// [`decode`] by way of generic msgpack values: slower, but it reads every shape and
/// says what is wrong with an event it skips.
fn decode_values(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader)
        .map_err(|e| DecodeError(format!("invalid msgpack: {e}")))?;
    if !reader.is_empty() {
        return Err(DecodeError(format!(
            "{} bytes after the batch",
            reader.len()
        )));
    }
    let (ts, events, rank) = match &value {
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank"),
        ),
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        other => {
            return Err(DecodeError(format!(
                "a batch is a map or an array, got {other}"
            )))
        }
    };
    let ts = ts
        .and_then(Value::as_f64)
        .or_else(|| ts.and_then(Value::as_i64).map(|v| v as f64))
        .ok_or_else(|| DecodeError("no `ts`".into()))?;
    let Some(Value::Array(raw_events)) = events else {
        return Err(DecodeError("no `events` list".into()));
    };
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| DecodeError(format!("`data_parallel_rank` is {v}")))?,
        ),
    };
    let mut batch = KvEventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        data_parallel_rank,
    };
    let mut skipped = Vec::new();
    for raw in raw_events {
        match event(raw) {
            Ok(e) => batch.events.push(e),
            Err(why) => skipped.push(why),
        }
    }
    Ok(DecodedBatch { batch, skipped })
}

/// The value of `key` in a msgpack map.
fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Reads one event: a map with a `type` tag, or an array whose first item is the tag.
fn event(raw: &Value) -> Result<KvCacheEvent, String> {
    /// Looks a field up by name, in a map or at its place in an array.
    type Getter<'a> = Box<dyn Fn(&str) -> Option<&'a Value> + 'a>;
    // Named fields of each event, in the order array-like structs put them.
    const STORED: [&str; 7] = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ];
    const REMOVED: [&str; 2] = ["block_hashes", "medium"];
    let (tag, get): (&str, Getter<'_>) = match raw {
        Value::Map(_) => {
            let tag = field(raw, "type")
                .and_then(Value::as_str)
                .ok_or("an event map without a `type` tag")?;
            (tag, Box::new(move |name| field(raw, name)))
        }
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or("an event array without a tag first")?;
            let order: &'static [&'static str] = match tag {
                "BlockStored" => &STORED,
                "BlockRemoved" => &REMOVED,
                _ => &[],
            };
            (
                tag,
                Box::new(move |name| {
                    let i = order.iter().position(|n| *n == name)?;
                    items.get(i + 1)
                }),
            )
        }
        other => return Err(format!("an event is a map or an array, got {other}")),
    };
    fn nil_or(v: Option<&Value>) -> Option<&Value> {
        v.filter(|v| !v.is_nil())
    }
    let text = |name: &str| -> Result<Option<String>, String> {
        match nil_or(get(name)) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| format!("{tag}.{name} is {v}")),
        }
    };
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(get("block_hashes"), tag)?;
            let parent_block_hash = nil_or(get("parent_block_hash"))
                .map(|v| hash(v).ok_or_else(|| format!("{tag}.parent_block_hash is {v}")))
                .transpose()?;
            let token_ids = match get("token_ids") {
                Some(Value::Array(tokens)) => tokens
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| format!("{tag}.token_ids holds a non-token"))?,
                other => return Err(format!("{tag}.token_ids is {other:?}")),
            };
            let block_size = get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or_else(|| format!("{tag}.block_size is missing or 0"))?;
            let lora_id = nil_or(get("lora_id")).and_then(Value::as_i64);
            Ok(KvCacheEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium: text("medium")?,
                lora_name: text("lora_name")?,
            })
        }
        "BlockRemoved" => Ok(KvCacheEvent::BlockRemoved {
            block_hashes: hashes(get("block_hashes"), tag)?,
            medium: text("medium")?,
        }),
        "AllBlocksCleared" => Ok(KvCacheEvent::AllBlocksCleared),
        other => Err(format!("unknown event type `{other}`")),
    }
}

fn hashes(value: Option<&Value>, tag: &str) -> Result<Vec<EngineBlockHash>, String> {
    match value {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| hash(v).ok_or_else(|| format!("{tag}.block_hashes holds {v}")))
            .collect(),
        other => Err(format!("{tag}.block_hashes is {other:?}")),
    }
}

fn hash(value: &Value) -> Option<EngineBlockHash> {
    match value {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|v| v as u64))
            .map(EngineBlockHash::Int),
        Value::Binary(b) => Some(EngineBlockHash::Bytes(b.clone())),
        _ => None,
    }
}

impl fmt::Display for EngineBlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Int(v) => write!(f, "{v}"),
            Self::Bytes(b) => b.iter().try_for_each(|byte| write!(f, "{byte:02x}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvCacheEvent {
        KvCacheEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| EngineBlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(EngineBlockHash::Int),
            token_ids: tokens,
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }
    }

    #[test]
    fn a_batch_round_trips_in_the_shape_vllm_publishes() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![
                KvCacheEvent::AllBlocksCleared,
                stored(&[7, 8], None, vec![1, 2, 3, 4]),
                KvCacheEvent::BlockRemoved {
                    block_hashes: vec![EngineBlockHash::Int(7)],
                    medium: None,
                },
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = encode(&batch);
        // The envelope an array, the events tagged maps, as msgspec writes them.
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let envelope = value.as_array().unwrap();
        assert_eq!(envelope.len(), 3);
        assert_eq!(envelope[0].as_f64(), Some(1.5));
        assert_eq!(envelope[2].as_u64(), Some(0));
        let events = envelope[1].as_array().unwrap();
        assert_eq!(
            field(&events[1], "type").and_then(Value::as_str),
            Some("BlockStored")
        );
        assert!(field(&events[1], "lora_name").unwrap().is_nil());
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.batch, batch);
        assert!(decoded.skipped.is_empty());
        // No rank: left out, not nil.
        let unranked = KvEventBatch {
            data_parallel_rank: None,
            ..batch
        };
        let bytes = encode(&unranked);
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        assert_eq!(value.as_array().unwrap().len(), 2);
        assert_eq!(decode(&bytes).unwrap().batch, unranked);
    }

    #[test]
    fn array_like_batches_bytes_hashes_and_negative_ints_are_read() {
        // [ts, [events], dp_rank] with array-like events, as vLLM 0.9 published them.
        let value = Value::Array(vec![
            Value::F64(2.0),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![Value::Binary(vec![0xab; 32])]),
                    Value::from(-5i64),
                    Value::Array(vec![Value::from(9u32), Value::from(10u32)]),
                    Value::from(2u32),
                    Value::Nil,
                    "GPU".into(),
                ]),
                Value::Array(vec![
                    "BlockRemoved".into(),
                    Value::Array(vec![Value::Binary(vec![0xab; 32])]),
                    Value::Nil,
                ]),
                Value::Array(vec!["AllBlocksCleared".into()]),
            ]),
            Value::from(1u32),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.batch.data_parallel_rank, Some(1));
        assert_eq!(decoded.batch.events.len(), 3);
        let KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            lora_name,
            ..
        } = &decoded.batch.events[0]
        else {
            panic!("{:?}", decoded.batch.events[0]);
        };
        assert_eq!(block_hashes, &[EngineBlockHash::Bytes(vec![0xab; 32])]);
        assert_eq!(parent_block_hash, &Some(EngineBlockHash::Int(-5i64 as u64)));
        assert_eq!(token_ids, &[9, 10]);
        assert_eq!(
            lora_name, &None,
            "an array that ends early leaves the rest unset"
        );
    }

    #[test]
    fn unknown_tags_and_bad_events_are_skipped_and_bad_envelopes_refused() {
        let value = Value::Map(vec![
            ("ts".into(), Value::F64(1.0)),
            (
                "events".into(),
                Value::Array(vec![
                    Value::Map(vec![("type".into(), "BlockPinned".into())]),
                    Value::Map(vec![
                        ("type".into(), "BlockStored".into()),
                        ("block_hashes".into(), Value::Array(vec![Value::from(1u32)])),
                        ("token_ids".into(), Value::Array(vec![Value::from(1u32)])),
                        ("block_size".into(), Value::from(0u32)),
                    ]),
                    Value::Map(vec![("type".into(), "AllBlocksCleared".into())]),
                ]),
            ),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.batch.events, vec![KvCacheEvent::AllBlocksCleared]);
        assert_eq!(decoded.skipped.len(), 2);
        assert!(
            decoded.skipped[0].contains("BlockPinned"),
            "{:?}",
            decoded.skipped
        );
        assert!(
            decoded.skipped[1].contains("block_size"),
            "{:?}",
            decoded.skipped
        );
        for garbage in [
            &b"\xc1"[..],
            b"",
            b"\x01",
            &encode_value(Value::Map(vec![])),
        ] {
            assert!(decode(garbage).is_err(), "{garbage:?}");
        }
        let mut trailing = encode(&KvEventBatch {
            ts: 0.0,
            events: vec![],
            data_parallel_rank: None,
        });
        trailing.push(0);
        assert!(decode(&trailing).is_err());
    }

    fn encode_value(value: Value) -> Vec<u8> {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        bytes
    }
}
