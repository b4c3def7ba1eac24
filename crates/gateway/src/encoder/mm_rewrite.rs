//! What the encoders reported, matched to the media items, and the metadata-only rewrite
//! of the request the prefill/decode workers get (vLLM's EPD wire format).
//!
//! An encoder answers with `ec_transfer_params`: per published embedding (keyed by its
//! `mm_hash`) the `metadata` its processor produced (e.g. the image grid), the positions
//! of the items in its sub-request (`item_indices`) and the connector's handles. Each
//! media item is then replaced by `{"type": "<kind>_embeds", "<kind>_embeds": metadata,
//! "uuid": ...}`, so the prefill/decode workers size the placeholders without the pixels
//! and fetch the embedding through the connector.

use pdserve_protocol::{ChatCompletionRequest, ChatMessage, MessageContent};
use serde_json::{json, Map, Value};

use crate::encoder::media::{content_uuid, MediaItem, MediaKind};

pub use pdserve_protocol::kv::EC_TRANSFER_PARAMS;

/// Keys of the gateway's own bookkeeping; never model metadata.
const CONTROL_KEYS: [&str; 3] = ["mm_hash", "ec_mm_hash", "transfer_id"];

/// What the encoders reported for one media item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemReport {
    /// The key both sides file the embedding under: the uuid this gateway sent, else the
    /// encoder's own hash.
    pub mm_hash: String,
    /// The encoder's key for the item (its connector handles are filed under it).
    pub ec_mm_hash: String,
    /// Model metadata that sizes the item's placeholder range (e.g. `image_grid_thw`).
    pub metadata: Map<String, Value>,
    /// The push connector's transfer id for the item, when one was assigned.
    pub transfer_id: Option<String>,
}

/// The keys this gateway assigned to a request's items (indexed like the items).
#[derive(Debug, Clone, Default)]
pub struct ItemKeys {
    /// The uuid sent with each item (`None` with `--no-rewrite`: the encoder hashes the
    /// raw item as the decoder will).
    pub uuids: Vec<Option<String>>,
    /// The transfer id sent with each item, when one was.
    pub transfer_ids: Vec<Option<String>>,
}

/// Facts about the request that decide how unmatched answers are treated.
#[derive(Debug, Clone, Copy)]
pub struct MatchContext<'a> {
    /// The request's media items.
    pub items: &'a [MediaItem<'a>],
    /// The keys assigned to them.
    pub keys: &'a ItemKeys,
    /// `mm_processor_kwargs.use_audio_in_video` is set.
    pub use_audio_in_video: bool,
    /// The encoders push to a named consumer (transfer handles must reach it).
    pub push: bool,
}

/// Reads one encoder answer (`params`: its `ec_transfer_params`) for the items at
/// `indices` into `reports`, and files its connector handles in `handles`. An error is
/// the 502 message: item indices out of range or repeated, or an answer that matches no
/// item.
pub fn match_answer(
    params: &Map<String, Value>,
    indices: &[usize],
    ctx: &MatchContext<'_>,
    reports: &mut [Option<ItemReport>],
    handles: &mut Map<String, Value>,
) -> Result<(), String> {
    if params.is_empty() {
        // Nothing reported: the raw items are kept.
        return Ok(());
    }
    // Positions only disambiguate a batch; a single item is matched directly.
    let mut by_position: Vec<Option<(&String, &Value)>> = vec![None; indices.len()];
    if indices.len() > 1 {
        for (hash, reported) in params {
            let positions = match reported.get("item_indices") {
                None | Some(Value::Null) => continue,
                Some(Value::Array(positions)) => positions,
                Some(other) => return Err(format!("invalid encoder item indices {other}")),
            };
            for position in positions {
                let local = position
                    .as_u64()
                    .map(|p| p as usize)
                    .filter(|&p| p < indices.len())
                    .ok_or_else(|| {
                        format!(
                            "invalid encoder item index {position} (the sub-request had {} items)",
                            indices.len()
                        )
                    })?;
                if by_position[local].replace((hash, reported)).is_some() {
                    return Err(format!("duplicate encoder item index {local}"));
                }
            }
        }
    }
    for (local, &index) in indices.iter().enumerate() {
        let uuid = ctx.keys.uuids.get(index).and_then(Option::as_ref);
        let matched = by_position[local]
            .or_else(|| uuid.and_then(|u| params.get_key_value(u.as_str())))
            .or_else(|| (indices.len() == 1 && params.len() == 1).then(|| params.iter().next())?);
        let Some((ec_mm_hash, reported)) = matched else {
            // A video with its audio track encoded alongside reports two entries; without
            // transfer handles to forward, the raw video keeps both features.
            if keeps_raw_video(ctx, index, params) {
                continue;
            }
            return Err(format!(
                "encoder metadata cannot be matched to the {} item at index {index}",
                ctx.items[index].kind.as_str()
            ));
        };
        let Some(entry) = reported.as_object() else {
            return Err(format!(
                "encoder reported {reported} for {ec_mm_hash}, not an object"
            ));
        };
        let metadata = match entry.get("metadata") {
            Some(Value::Object(m)) => m
                .iter()
                .filter(|(k, _)| !CONTROL_KEYS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            _ => Map::new(),
        };
        reports[index] = Some(ItemReport {
            mm_hash: uuid.cloned().unwrap_or_else(|| ec_mm_hash.clone()),
            ec_mm_hash: ec_mm_hash.clone(),
            metadata,
            transfer_id: ctx.keys.transfer_ids.get(index).cloned().flatten(),
        });
        handles.insert(ec_mm_hash.clone(), reported.clone());
    }
    Ok(())
}

fn keeps_raw_video(ctx: &MatchContext<'_>, index: usize, params: &Map<String, Value>) -> bool {
    ctx.items[index].kind == MediaKind::VideoUrl
        && ctx.use_audio_in_video
        && params.len() == 2
        && !ctx.push
        && params.values().all(|entry| {
            entry.as_object().is_some_and(|o| {
                o.keys()
                    .all(|k| k.as_str() == "metadata" || k.as_str() == "item_indices")
            })
        })
}

/// `{"mm_hash": ..., "transfer_id": ...}` entries of `ec_items` for `reports` that carry a
/// transfer id.
pub fn transfer_items<'a>(reports: impl Iterator<Item = &'a ItemReport>) -> Vec<Value> {
    reports
        .filter_map(|r| {
            let id = r.transfer_id.as_ref()?;
            Some(json!({"mm_hash": r.ec_mm_hash, "transfer_id": id}))
        })
        .collect()
}

/// The request with every media item that has a report replaced by a metadata reference;
/// `None` when nothing changes (no item was reported).
///
/// When the request has an audio item and some item cannot be rewritten (no report, or no
/// metadata), every item is kept raw, with its uuid: audio processors may consume other
/// modalities' placeholders, so a half-rewritten request is not safe.
pub fn rewrite(
    request: &ChatCompletionRequest,
    items: &[MediaItem<'_>],
    reports: &[Option<ItemReport>],
) -> Option<ChatCompletionRequest> {
    let unreported = |i: usize| reports[i].as_ref().is_none_or(|r| r.metadata.is_empty());
    let raw_audio = items.iter().any(|i| i.kind.is_audio()) && (0..items.len()).any(unreported);
    let mut transfers = Vec::new();
    let mut rewritten = 0;
    let mut index = 0;
    let messages: Vec<ChatMessage> = request
        .messages
        .iter()
        .map(|message| {
            let Some(MessageContent::Parts(parts)) = &message.content else {
                return message.clone();
            };
            let parts = parts
                .iter()
                .map(|part| {
                    let Some(kind) = MediaKind::of(part) else {
                        return part.clone();
                    };
                    let report = reports[index].as_ref();
                    index += 1;
                    if raw_audio {
                        transfers.extend(report.filter(|r| r.transfer_id.is_some()));
                        let uuid = report
                            .map(|r| r.mm_hash.clone())
                            .or_else(|| {
                                part.get("uuid").and_then(Value::as_str).map(str::to_string)
                            })
                            .unwrap_or_else(|| content_uuid(part));
                        let mut raw = part.clone();
                        if let Some(object) = raw.as_object_mut() {
                            object.insert("uuid".into(), Value::String(uuid));
                        }
                        return raw;
                    }
                    match report.filter(|r| !r.metadata.is_empty()) {
                        // Nothing to size the placeholders with: the worker gets the
                        // media and derives the grid itself.
                        None => part.clone(),
                        Some(report) => {
                            transfers.extend(report.transfer_id.as_ref().map(|_| report));
                            rewritten += 1;
                            let embeds = kind.embeds_type();
                            json!({
                                "type": embeds,
                                embeds: flatten_metadata(&report.metadata),
                                "uuid": report.mm_hash,
                            })
                        }
                    }
                })
                .collect();
            ChatMessage {
                role: message.role.clone(),
                content: Some(MessageContent::Parts(parts)),
                extra: message.extra.clone(),
            }
        })
        .collect();
    if rewritten == 0 && !raw_audio {
        return None;
    }
    let mut out = ChatCompletionRequest {
        model: request.model.clone(),
        messages,
        logprobs: request.logprobs,
        top_logprobs: request.top_logprobs,
        generation: request.generation.clone(),
        transport: request.transport.clone(),
        extra: request.extra.clone(),
        verbatim_numbers: request.verbatim_numbers.clone(),
    };
    let transfers = transfer_items(transfers.into_iter());
    if !transfers.is_empty() {
        let mut params = Map::new();
        params.insert("ec_items".into(), Value::Array(transfers));
        merge_ec_params(&mut out.extra, params);
    }
    Some(out)
}

/// Metadata as the workers stack it per item: each value a flat list (one level of
/// nesting removed, as the encoders report one entry per item).
fn flatten_metadata(metadata: &Map<String, Value>) -> Value {
    let flat = metadata
        .iter()
        .map(|(key, value)| {
            let values = match value {
                Value::Array(entries) => entries
                    .iter()
                    .flat_map(|entry| match entry {
                        Value::Array(inner) => inner.clone(),
                        other => vec![other.clone()],
                    })
                    .collect(),
                other => vec![other.clone()],
            };
            (key.clone(), Value::Array(values))
        })
        .collect();
    Value::Object(flat)
}

/// Merges `params` into the request's `ec_transfer_params` (created, or replacing a value
/// that is not an object).
pub fn merge_ec_params(extra: &mut Map<String, Value>, params: Map<String, Value>) {
    let slot = extra
        .entry(EC_TRANSFER_PARAMS)
        .or_insert_with(|| Value::Object(Map::new()));
    if !slot.is_object() {
        *slot = Value::Object(Map::new());
    }
    if let Some(object) = slot.as_object_mut() {
        object.extend(params);
    }
}

#[cfg(test)]
#[path = "mm_rewrite_tests.rs"]
mod tests;
