//! Event batches read straight from their msgpack bytes into typed events, for the shapes
//! publishers write (vLLM's array envelope of map events, older map envelopes, array
//! events): no tree of generic values in between, no allocation but the events' own
//! vectors. A gateway applies every block a fleet stores; building each token id as a
//! generic value and dropping it again took as long as indexing the block.
//!
//! Anything unexpected (an unknown event type, a field of the wrong type, a duplicate
//! field, a non-string key) makes it give up, and [`super::decode`] reads the batch the
//! general way, which names what is wrong and skips only that event. So a batch read
//! here is exactly what the general reader would have made of it.

use rmp::decode::{self as mp, RmpRead};
use rmp::Marker;

use super::{EngineBlockHash, KvCacheEvent, KvEventBatch};

/// The bytes not read yet.
type Bytes<'a> = &'a [u8];

/// The batch in `payload`, or `None` where the general reader must look.
pub(super) fn read_batch(payload: &[u8]) -> Option<KvEventBatch> {
    let mut rd = payload;
    let batch = match mp::read_marker(&mut rd).ok()? {
        marker @ (Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
            let len = array_len(&mut rd, marker)?;
            if !(2..=3).contains(&len) {
                return None;
            }
            let ts = number(&mut rd)?;
            let events = events(&mut rd)?;
            let data_parallel_rank = if len == 3 { rank(&mut rd)? } else { None };
            KvEventBatch {
                ts,
                events,
                data_parallel_rank,
            }
        }
        marker @ (Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
            let len = mp::marker_to_len(&mut rd, marker).ok()?;
            let (mut ts, mut events_read, mut rank_read) = (None, None, None);
            for _ in 0..len {
                match key(&mut rd)? {
                    b"ts" if ts.is_none() => ts = Some(number(&mut rd)?),
                    b"events" if events_read.is_none() => events_read = Some(events(&mut rd)?),
                    b"data_parallel_rank" if rank_read.is_none() => {
                        rank_read = Some(rank(&mut rd)?)
                    }
                    _ => return None,
                }
            }
            KvEventBatch {
                ts: ts?,
                events: events_read?,
                data_parallel_rank: rank_read.flatten(),
            }
        }
        _ => return None,
    };
    rd.is_empty().then_some(batch)
}

fn array_len(rd: &mut Bytes<'_>, marker: Marker) -> Option<u32> {
    match marker {
        Marker::FixArray(n) => Some(u32::from(n)),
        Marker::Array16 => rd.read_data_u16().ok().map(u32::from),
        Marker::Array32 => rd.read_data_u32().ok(),
        _ => None,
    }
}

/// The length of the array that comes next.
fn next_array_len(rd: &mut Bytes<'_>) -> Option<u32> {
    mp::read_array_len(rd).ok()
}

/// Whether a nil comes next (and is taken).
fn nil(rd: &mut Bytes<'_>) -> bool {
    let is_nil = rd.first() == Some(&0xc0);
    if is_nil {
        *rd = &rd[1..];
    }
    is_nil
}

/// The bytes of the string that comes next, unchecked (map keys, compared as bytes).
fn raw_str<'a>(rd: &mut Bytes<'a>) -> Option<&'a [u8]> {
    let len = mp::read_str_len(rd).ok()? as usize;
    let (text, rest) = rd.split_at_checked(len)?;
    *rd = rest;
    Some(text)
}

fn key<'a>(rd: &mut Bytes<'a>) -> Option<&'a [u8]> {
    raw_str(rd)
}

fn text<'a>(rd: &mut Bytes<'a>) -> Option<&'a str> {
    std::str::from_utf8(raw_str(rd)?).ok()
}

/// A nil or a string.
fn optional_text(rd: &mut Bytes<'_>) -> Option<Option<String>> {
    if nil(rd) {
        return Some(None);
    }
    text(rd).map(|t| Some(t.to_string()))
}

/// A float, or an integer read as one (as the general reader takes `ts`).
fn number(rd: &mut Bytes<'_>) -> Option<f64> {
    let marker = mp::read_marker(rd).ok()?;
    Some(match marker {
        Marker::F64 => rd.read_data_f64().ok()?,
        Marker::F32 => f64::from(rd.read_data_f32().ok()?),
        other => integer(rd, other)?.as_f64(),
    })
}

/// An integer's value: unsigned when it is not negative.
#[derive(Clone, Copy)]
enum Integer {
    Unsigned(u64),
    Negative(i64),
}

impl Integer {
    fn as_f64(self) -> f64 {
        match self {
            Self::Unsigned(v) => v as f64,
            Self::Negative(v) => v as f64,
        }
    }
}

/// The integer that `marker` starts.
fn integer(rd: &mut Bytes<'_>, marker: Marker) -> Option<Integer> {
    let signed = |v: i64| {
        if v < 0 {
            Integer::Negative(v)
        } else {
            Integer::Unsigned(v as u64)
        }
    };
    Some(match marker {
        Marker::FixPos(v) => Integer::Unsigned(u64::from(v)),
        Marker::U8 => Integer::Unsigned(u64::from(rd.read_data_u8().ok()?)),
        Marker::U16 => Integer::Unsigned(u64::from(rd.read_data_u16().ok()?)),
        Marker::U32 => Integer::Unsigned(u64::from(rd.read_data_u32().ok()?)),
        Marker::U64 => Integer::Unsigned(rd.read_data_u64().ok()?),
        Marker::FixNeg(v) => signed(i64::from(v)),
        Marker::I8 => signed(i64::from(rd.read_data_i8().ok()?)),
        Marker::I16 => signed(i64::from(rd.read_data_i16().ok()?)),
        Marker::I32 => signed(i64::from(rd.read_data_i32().ok()?)),
        Marker::I64 => signed(rd.read_data_i64().ok()?),
        _ => return None,
    })
}

/// A non-negative integer that fits a `u32`.
fn small_unsigned(rd: &mut Bytes<'_>) -> Option<u32> {
    // Token ids: nearly always a positive fixint or a u16/u32.
    let marker = mp::read_marker(rd).ok()?;
    match integer(rd, marker)? {
        Integer::Unsigned(v) => u32::try_from(v).ok(),
        Integer::Negative(_) => None,
    }
}

/// A nil (`None`), else a data-parallel rank.
fn rank(rd: &mut Bytes<'_>) -> Option<Option<u32>> {
    if nil(rd) {
        return Some(None);
    }
    small_unsigned(rd).map(Some)
}

/// An engine's block hash: an integer (negative ones as two's complement) or bytes.
fn hash(rd: &mut Bytes<'_>) -> Option<EngineBlockHash> {
    let marker = mp::read_marker(rd).ok()?;
    let len = match marker {
        Marker::Bin8 => usize::from(rd.read_data_u8().ok()?),
        Marker::Bin16 => usize::from(rd.read_data_u16().ok()?),
        Marker::Bin32 => rd.read_data_u32().ok()? as usize,
        other => {
            return Some(EngineBlockHash::Int(match integer(rd, other)? {
                Integer::Unsigned(v) => v,
                Integer::Negative(v) => v as u64,
            }))
        }
    };
    let (bytes, rest) = rd.split_at_checked(len)?;
    *rd = rest;
    Some(EngineBlockHash::Bytes(bytes.to_vec()))
}

/// An array whose items `item` reads.
fn array<T>(rd: &mut Bytes<'_>, item: impl Fn(&mut Bytes<'_>) -> Option<T>) -> Option<Vec<T>> {
    let len = next_array_len(rd)? as usize;
    // A length is only trusted as far as the bytes could hold it.
    let mut items = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        items.push(item(rd)?);
    }
    Some(items)
}

fn hashes(rd: &mut Bytes<'_>) -> Option<Vec<EngineBlockHash>> {
    array(rd, hash)
}

fn tokens(rd: &mut Bytes<'_>) -> Option<Vec<u32>> {
    array(rd, small_unsigned)
}

fn events(rd: &mut Bytes<'_>) -> Option<Vec<KvCacheEvent>> {
    array(rd, event)
}

/// An event's fields, as they were found.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineBlockHash>>,
    parent_block_hash: Option<Option<EngineBlockHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
}

/// The fields of a `BlockStored` in the order array-like events put them (after the tag).
const STORED_ORDER: [&[u8]; 7] = [
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"medium",
    b"lora_name",
];

/// The fields of a `BlockRemoved`, likewise.
const REMOVED_ORDER: [&[u8]; 2] = [b"block_hashes", b"medium"];

impl Fields {
    /// Reads field `name`'s value: `Some(false)` for a field no event has (its value is
    /// skipped), `None` to give up (a wrong type, a field seen twice).
    fn read(&mut self, name: &[u8], rd: &mut Bytes<'_>) -> Option<bool> {
        fn once<T>(slot: &mut Option<T>, value: Option<T>) -> Option<bool> {
            if slot.is_some() {
                return None;
            }
            *slot = Some(value?);
            Some(true)
        }
        match name {
            b"block_hashes" => once(&mut self.block_hashes, hashes(rd)),
            b"parent_block_hash" => {
                let parent = if nil(rd) {
                    Some(None)
                } else {
                    hash(rd).map(Some)
                };
                once(&mut self.parent_block_hash, parent)
            }
            b"token_ids" => once(&mut self.token_ids, tokens(rd)),
            b"block_size" => once(&mut self.block_size, small_unsigned(rd).filter(|b| *b > 0)),
            b"lora_id" => {
                let lora_id = if nil(rd) {
                    Some(None)
                } else {
                    let marker = mp::read_marker(rd).ok()?;
                    match integer(rd, marker)? {
                        Integer::Unsigned(v) => i64::try_from(v).ok().map(Some),
                        Integer::Negative(v) => Some(Some(v)),
                    }
                };
                once(&mut self.lora_id, lora_id)
            }
            b"medium" => once(&mut self.medium, optional_text(rd)),
            b"lora_name" => once(&mut self.lora_name, optional_text(rd)),
            _ => {
                rmpv::decode::read_value_ref(rd).ok()?;
                Some(false)
            }
        }
    }

    /// The event these fields make with tag `tag`.
    fn event(self, tag: &[u8]) -> Option<KvCacheEvent> {
        match tag {
            b"BlockStored" => Some(KvCacheEvent::BlockStored {
                block_hashes: self.block_hashes?,
                parent_block_hash: self.parent_block_hash.flatten(),
                token_ids: self.token_ids?,
                block_size: self.block_size?,
                lora_id: self.lora_id.flatten(),
                medium: self.medium.flatten(),
                lora_name: self.lora_name.flatten(),
            }),
            b"BlockRemoved" => Some(KvCacheEvent::BlockRemoved {
                block_hashes: self.block_hashes?,
                medium: self.medium.flatten(),
            }),
            b"AllBlocksCleared" => Some(KvCacheEvent::AllBlocksCleared),
            _ => None,
        }
    }
}

/// One event: a map tagged by `type`, or an array whose first item is the tag.
fn event(rd: &mut Bytes<'_>) -> Option<KvCacheEvent> {
    let mut fields = Fields::default();
    let marker = mp::read_marker(rd).ok()?;
    match marker {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let len = mp::marker_to_len(rd, marker).ok()?;
            let mut tag = None;
            for _ in 0..len {
                let name = key(rd)?;
                if name == b"type" {
                    if tag.is_some() {
                        return None;
                    }
                    tag = Some(text(rd)?.as_bytes());
                } else {
                    fields.read(name, rd)?;
                }
            }
            fields.event(tag?)
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let len = array_len(rd, marker)?;
            if len == 0 {
                return None;
            }
            let tag = text(rd)?.as_bytes();
            let order: &[&[u8]] = match tag {
                b"BlockStored" => &STORED_ORDER,
                b"BlockRemoved" => &REMOVED_ORDER,
                _ => &[],
            };
            for at in 0..(len - 1) as usize {
                match order.get(at) {
                    Some(name) => {
                        fields.read(name, rd)?;
                    }
                    None => {
                        rmpv::decode::read_value_ref(rd).ok()?;
                    }
                }
            }
            fields.event(tag)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use rmpv::Value;

    use super::super::{decode_values, encode};
    use super::*;

    fn stored(hashes: Vec<EngineBlockHash>, parent: Option<EngineBlockHash>) -> KvCacheEvent {
        KvCacheEvent::BlockStored {
            token_ids: (0..hashes.len() as u32 * 2).map(|t| t * 40_000).collect(),
            block_hashes: hashes,
            parent_block_hash: parent,
            block_size: 2,
            lora_id: Some(-3),
            medium: Some("GPU".into()),
            lora_name: Some("adapter".into()),
        }
    }

    fn bytes_of(value: &Value) -> Vec<u8> {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, value).unwrap();
        bytes
    }

    /// Payloads in every shape the reader takes: vLLM 0.32's, a map envelope, array
    /// events, negative and digest hashes, an unknown field.
    fn payloads() -> Vec<Vec<u8>> {
        let batch = KvEventBatch {
            ts: 1_765_000_000.25,
            events: vec![
                KvCacheEvent::AllBlocksCleared,
                stored(
                    vec![EngineBlockHash::Int(u64::MAX), EngineBlockHash::Int(7)],
                    Some(EngineBlockHash::Bytes(vec![0xab; 32])),
                ),
                KvCacheEvent::BlockRemoved {
                    block_hashes: vec![EngineBlockHash::Int(7)],
                    medium: None,
                },
            ],
            data_parallel_rank: Some(3),
        };
        let map_envelope = Value::Map(vec![
            ("ts".into(), Value::from(12u32)),
            (
                "events".into(),
                Value::Array(vec![Value::Map(vec![
                    ("type".into(), "BlockStored".into()),
                    (
                        "block_hashes".into(),
                        Value::Array(vec![Value::from(-5i64)]),
                    ),
                    (
                        "token_ids".into(),
                        Value::Array(vec![1u32.into(), 70_000u32.into()]),
                    ),
                    ("block_size".into(), Value::from(2u32)),
                    (
                        "extra_keys".into(),
                        Value::Array(vec![Value::Nil, "x".into()]),
                    ),
                    ("parent_block_hash".into(), Value::Nil),
                ])]),
            ),
            ("data_parallel_rank".into(), Value::Nil),
        ]);
        let array_events = Value::Array(vec![
            Value::F32(2.5),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![Value::Binary(vec![1; 32]), Value::from(9u64)]),
                    Value::from(300u32),
                    Value::Array((0..4u32).map(Value::from).collect()),
                    Value::from(2u32),
                    Value::Nil,
                    "CPU".into(),
                ]),
                Value::Array(vec![
                    "BlockRemoved".into(),
                    Value::Array(vec![Value::from(9u64)]),
                    Value::Nil,
                    "a later field".into(),
                ]),
                Value::Array(vec!["AllBlocksCleared".into(), Value::from(1u32)]),
            ]),
        ]);
        vec![
            encode(&batch),
            encode(&KvEventBatch {
                data_parallel_rank: None,
                ..batch
            }),
            bytes_of(&map_envelope),
            bytes_of(&array_events),
        ]
    }

    #[test]
    fn every_shape_publishers_write_is_read_as_the_general_reader_reads_it() {
        for payload in payloads() {
            let read = read_batch(&payload).expect("a common shape is read directly");
            let general = decode_values(&payload).unwrap();
            assert!(general.skipped.is_empty(), "{:?}", general.skipped);
            assert_eq!(read, general.batch);
        }
    }

    #[test]
    fn what_the_reader_makes_of_damaged_bytes_the_general_reader_makes_too() {
        // Damaged payloads: where the direct reader reads a batch at all, it must be the
        // one the general reader reads, with nothing skipped; everything else (an unknown
        // tag, a wrong type, a cut-off array) it leaves to the general reader.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut read, mut left) = (0, 0);
        for payload in payloads() {
            for _ in 0..3000 {
                let mut damaged = payload.clone();
                for _ in 0..1 + next() % 3 {
                    let at = (next() % damaged.len() as u64) as usize;
                    match next() % 4 {
                        0 => damaged.truncate(at),
                        1 => damaged.insert(at, next() as u8),
                        _ => damaged[at] = next() as u8,
                    }
                    if damaged.is_empty() {
                        break;
                    }
                }
                match read_batch(&damaged) {
                    Some(batch) => {
                        read += 1;
                        let general = decode_values(&damaged).expect("the general reader reads it");
                        assert!(general.skipped.is_empty(), "{:?}", general.skipped);
                        assert_eq!(batch, general.batch, "{damaged:?}");
                    }
                    None => left += 1,
                }
            }
        }
        // Both outcomes happen: the check above was exercised.
        assert!(read > 100 && left > 100, "read {read}, left {left}");
    }

    #[test]
    fn unexpected_shapes_go_to_the_general_reader() {
        let unknown_tag = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Map(vec![(
                "type".into(),
                "BlockPinned".into(),
            )])]),
        ]);
        let twice = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Map(vec![
                ("type".into(), "BlockRemoved".into()),
                ("block_hashes".into(), Value::Array(vec![])),
                ("block_hashes".into(), Value::Array(vec![Value::from(1u32)])),
            ])]),
        ]);
        let negative_token = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                Value::Array(vec![Value::from(1u32)]),
                Value::Nil,
                Value::Array(vec![Value::from(-1i64)]),
                Value::from(1u32),
            ])]),
        ]);
        for value in [unknown_tag, twice, negative_token] {
            let bytes = bytes_of(&value);
            assert_eq!(read_batch(&bytes), None, "{value}");
            // The general reader takes them, and says what it skipped or keeps the first.
            assert!(decode_values(&bytes).is_ok());
        }
    }
}
