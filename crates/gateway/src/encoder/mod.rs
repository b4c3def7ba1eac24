//! The encoder stage: every media item goes to an encode worker (round-robin with a
//! cursor that continues across requests); images assigned to the same encoder share a
//! sub-request (up to `--encoder-max-batch-size`), other media go one per sub-request.
//! Sub-requests run concurrently; the first failure fails the request and drops (so
//! cancels) the others.
//!
//! A sub-request is vLLM's encoder request: a chat request whose one user message holds
//! only the media items (no text), each with its content-derived `uuid`, `stream: false`,
//! a child request id `<request id>:<first item index>:<random>`, and the client's
//! `mm_processor_kwargs`, `media_io_kwargs`, `priority` and `session_id`.

pub mod media;
pub mod mm_rewrite;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use http::HeaderValue;
use pdserve_protocol::{ApiError, ChatCompletionRequest, WorkerRole};
use serde_json::{json, Map, Value};

use self::media::{item_uuid, MediaItem, MediaKind};
use self::mm_rewrite::{
    match_answer, transfer_items, ItemKeys, ItemReport, MatchContext, EC_TRANSFER_PARAMS,
};
use crate::clients::worker_client::{Exchange, ForwardHeaders, LegFault};
use crate::endpoint::Endpoint;
use crate::error::Failure;
use crate::fleet::registry::Worker;
use crate::legs::RequestContext;
use crate::policy::RequestOutcome;
use crate::serving::Serving;

/// Client fields an encoder needs to process the media as the consumer will.
const PASSTHROUGH: [&str; 4] = [
    "mm_processor_kwargs",
    "media_io_kwargs",
    "priority",
    "session_id",
];

/// What the encoder stage produced.
#[derive(Debug, Default)]
pub struct Encoded {
    /// Per item, what its encoder reported (`None`: nothing; the raw item is kept).
    pub reports: Vec<Option<ItemReport>>,
    /// Connector handles for the prefill/decode body's `ec_transfer_params`.
    pub handles: Map<String, Value>,
    /// Sub-requests sent.
    pub sub_requests: usize,
}

/// One sub-request: an encoder and the indices of the items it gets.
#[derive(Debug)]
struct Group {
    encoder: Arc<Worker>,
    items: Vec<usize>,
}

/// Assigns `items` to `encoders` (one per item, in order) and groups them: images for
/// the same encoder together, at most `max_batch` per group (0: unlimited), every other
/// item alone. Groups keep the order of their first item.
fn group(items: &[MediaItem<'_>], encoders: Vec<Arc<Worker>>, max_batch: usize) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    // Encoder URL → the group its images currently fill.
    let mut open_images: HashMap<String, usize> = HashMap::new();
    for (index, (item, encoder)) in items.iter().zip(encoders).enumerate() {
        if item.kind != MediaKind::ImageUrl {
            groups.push(Group {
                encoder,
                items: vec![index],
            });
            continue;
        }
        let open = open_images
            .get(&encoder.base)
            .copied()
            .filter(|&g| max_batch == 0 || groups[g].items.len() < max_batch);
        match open {
            Some(g) => groups[g].items.push(index),
            None => {
                open_images.insert(encoder.base.clone(), groups.len());
                groups.push(Group {
                    encoder,
                    items: vec![index],
                });
            }
        }
    }
    groups
}

/// Runs the encoder stage for `items` of `request`. `consumer_zmq` names the replica the
/// encoders push to (push connectors). Fails with the encoder's 4xx, else a 502.
pub async fn encode(
    state: &Arc<Serving>,
    ctx: &RequestContext,
    request: &ChatCompletionRequest,
    items: &[MediaItem<'_>],
    consumer_zmq: Option<&str>,
) -> Result<Encoded, Failure> {
    let encoders = state.registry.assign(WorkerRole::Encode, items.len());
    if encoders.is_empty() {
        return Err(ApiError::service_unavailable(
            "no healthy encode worker is available for this request's media items",
        )
        .into());
    }
    let no_rewrite = state.settings.no_rewrite;
    // With --no-rewrite the consumer gets the raw media and hashes it itself, so the
    // encoder must do the same: a uuid here would make the two keys disagree.
    let uuids: Vec<Option<String>> = items
        .iter()
        .map(|item| (!no_rewrite).then(|| item_uuid(item.part)))
        .collect();
    let transfer_ids = uuids
        .iter()
        .map(|uuid| {
            (uuid.is_some() || consumer_zmq.is_some())
                .then(|| uuid::Uuid::new_v4().simple().to_string())
        })
        .collect();
    let keys = ItemKeys {
        uuids,
        transfer_ids,
    };
    let groups = group(items, encoders, state.settings.encoder_max_batch_size);
    state.metrics.inc_encoder_sub_requests(groups.len() as u64);

    let mut pending: FuturesUnordered<_> = groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let body = sub_request(request, items, &group.items, &keys, consumer_zmq);
            let headers = ForwardHeaders {
                request_id: child_request_id(ctx, group.items[0]),
                authorization: ctx.headers.authorization.clone(),
                hops: ctx.headers.hops.clone(),
                traceparent: ctx.headers.traceparent.clone(),
                tracestate: ctx.headers.tracestate.clone(),
            };
            async move { (g, send(state, &group.encoder, body, &headers).await) }
        })
        .collect();
    let mut answers: Vec<Option<Bytes>> = vec![None; groups.len()];
    while let Some((g, result)) = pending.next().await {
        // Returning drops `pending`: the other sub-requests' connections close.
        answers[g] = Some(result?);
    }
    drop(pending);

    let ctx = MatchContext {
        items,
        keys: &keys,
        use_audio_in_video: request
            .extra
            .get("mm_processor_kwargs")
            .and_then(|k| k.get("use_audio_in_video"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        push: consumer_zmq.is_some(),
    };
    let mut encoded = Encoded {
        reports: vec![None; items.len()],
        handles: Map::new(),
        sub_requests: groups.len(),
    };
    for (group, answer) in groups.iter().zip(answers) {
        let params = answer.as_deref().map(ec_params_of).unwrap_or_default();
        match_answer(
            &params,
            &group.items,
            &ctx,
            &mut encoded.reports,
            &mut encoded.handles,
        )
        .map_err(|why| {
            ApiError::bad_gateway(format!("encode worker {}: {why}", group.encoder.base))
        })?;
    }
    if no_rewrite && consumer_zmq.is_some() {
        // The raw request still needs the push transfers named.
        let items = transfer_items(encoded.reports.iter().flatten());
        if !items.is_empty() {
            encoded
                .handles
                .insert("ec_items".into(), Value::Array(items));
        }
    }
    Ok(encoded)
}

/// The encoder sub-request body for the items at `indices`.
fn sub_request(
    request: &ChatCompletionRequest,
    items: &[MediaItem<'_>],
    indices: &[usize],
    keys: &ItemKeys,
    consumer_zmq: Option<&str>,
) -> Bytes {
    let content: Vec<Value> = indices
        .iter()
        .map(|&i| {
            let mut part = items[i].part.clone();
            if let (Some(uuid), Some(object)) = (&keys.uuids[i], part.as_object_mut()) {
                object.insert("uuid".into(), Value::String(uuid.clone()));
            }
            part
        })
        .collect();
    let mut body = Map::new();
    if let Some(model) = &request.model {
        body.insert("model".into(), Value::String(model.clone()));
    }
    body.insert(
        "messages".into(),
        json!([{"role": "user", "content": content}]),
    );
    // No max_tokens: an encoder never samples; it finishes once the media is encoded
    // and the embeddings are published.
    body.insert("stream".into(), Value::Bool(false));
    for key in PASSTHROUGH {
        if let Some(value) = request.extra.get(key) {
            body.insert(key.into(), value.clone());
        } else if let Some((_, text)) = request.verbatim_numbers.iter().find(|(k, _)| k == key) {
            // A top-level number (`priority`) is held as the client's text.
            if let Ok(value) = serde_json::from_str::<Value>(text) {
                body.insert(key.into(), value);
            }
        }
    }
    if let Some(zmq) = consumer_zmq {
        // Engines may rehash uuids with processing options: transfers match by position.
        let transfers: Vec<Value> = indices
            .iter()
            .map(|&i| json!({"transfer_id": keys.transfer_ids[i]}))
            .collect();
        body.insert(
            EC_TRANSFER_PARAMS.into(),
            json!({"consumer_zmq": zmq, "ec_items": transfers}),
        );
    }
    Bytes::from(serde_json::to_vec(&Value::Object(body)).unwrap_or_default())
}

/// `<request id>:<first item index>:<6 random hex digits>`.
fn child_request_id(ctx: &RequestContext, first: usize) -> HeaderValue {
    let random = uuid::Uuid::new_v4().simple().to_string();
    let id = format!("{}:{first}:{}", ctx.headers.request_id(), &random[..6]);
    HeaderValue::from_str(&id).unwrap_or_else(|_| {
        HeaderValue::from_str(&random).expect("hex digits are a valid header value")
    })
}

/// Sends one sub-request and reads the answer. An encoder's 4xx is passed through; any
/// other failure is a 502.
async fn send(
    state: &Arc<Serving>,
    encoder: &Arc<Worker>,
    body: Bytes,
    headers: &ForwardHeaders,
) -> Result<Bytes, Failure> {
    let mut in_flight = state.start_request(encoder.clone());
    let exchange = Exchange::new(encoder, "encode worker", state.settings.prefill_timeout);
    let url = encoder.url(Endpoint::Chat);
    // The fan-out runs on the request's task: its span is the current one.
    let cx = pdserve_telemetry::current();
    let span = crate::observe::trace::leg(cx.as_ref(), "encode", encoder, url.as_str());
    let leg_headers = crate::observe::trace::leg_headers(headers, span.as_ref());
    let request = state.client.post_json(url, body, &leg_headers);
    let result = exchange.send_and_read(request).await;
    crate::observe::trace::leg_done(span, &result);
    if result.is_ok() {
        state.registry.record_answer(encoder);
    }
    in_flight.set_outcome(match &result {
        Ok(_) => RequestOutcome::Success,
        Err(e) if e.is_worker_fault() => RequestOutcome::Failure,
        Err(_) => RequestOutcome::Other,
    });
    result.map_err(|e| {
        state.report(encoder, &e);
        tracing::warn!(
            request_id = headers.request_id(),
            encoder = %encoder.base,
            "encoder sub-request failed: {}",
            e.failure_message()
        );
        match e.kind {
            LegFault::Rejected => e.failure,
            _ => ApiError::bad_gateway(format!(
                "encoder sub-request failed: {}",
                e.failure_message()
            ))
            .into(),
        }
    })
}

/// The `ec_transfer_params` object of an encoder's answer (empty when it has none or the
/// answer is not JSON: the items then stay raw, as with vLLM).
fn ec_params_of(body: &[u8]) -> Map<String, Value> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut answer)) => match answer.remove(EC_TRANSFER_PARAMS) {
            Some(Value::Object(params)) => params,
            _ => Map::new(),
        },
        _ => {
            tracing::warn!(
                "an encoder answered with a body that is not a JSON object; its items stay raw"
            );
            Map::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use self::media::extract;
    use super::*;
    use crate::fleet::registry::WorkerSpec;
    use prometheus_client::metrics::gauge::Gauge;

    fn worker(port: u16) -> Arc<Worker> {
        let url = format!("http://127.0.0.1:{port}").parse().unwrap();
        Arc::new(Worker::new(
            WorkerSpec::new(WorkerRole::Encode, url),
            Gauge::default(),
        ))
    }

    fn request(parts: Value) -> ChatCompletionRequest {
        serde_json::from_value(json!({
            "model": "m",
            "messages": [{"role": "user", "content": parts}],
            "max_tokens": 9,
            "temperature": 0.5,
            "mm_processor_kwargs": {"fps": 2},
            "priority": 3,
            "other": true,
        }))
        .unwrap()
    }

    fn image(n: u32) -> Value {
        json!({"type": "image_url", "image_url": {"url": format!("http://x/{n}.png")}})
    }

    #[test]
    fn images_for_one_encoder_share_a_sub_request_up_to_the_batch_size() {
        let audio = json!({"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}});
        let r = request(json!([
            image(0),
            image(1),
            image(2),
            audio,
            image(4),
            image(5)
        ]));
        let items = extract(&r);
        let (a, b) = (worker(1), worker(2));
        let assign = || {
            vec![
                a.clone(),
                b.clone(),
                a.clone(),
                b.clone(),
                a.clone(),
                b.clone(),
            ]
        };
        let shape = |groups: Vec<Group>| {
            groups
                .into_iter()
                .map(|g| (g.encoder.spec.url.port().unwrap(), g.items))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shape(group(&items, assign(), 0)),
            [(1, vec![0, 2, 4]), (2, vec![1, 5]), (2, vec![3])]
        );
        assert_eq!(
            shape(group(&items, assign(), 2)),
            [(1, vec![0, 2]), (2, vec![1, 5]), (2, vec![3]), (1, vec![4])]
        );
        assert_eq!(shape(group(&items, assign(), 1)).len(), 6);
    }

    #[test]
    fn sub_requests_carry_only_media_uuids_and_passthrough_fields() {
        let r = request(json!([{"type": "text", "text": "what is this?"}, image(0), image(1)]));
        let items = extract(&r);
        let keys = ItemKeys {
            uuids: vec![Some("u0".into()), Some("u1".into())],
            transfer_ids: vec![Some("t0".into()), Some("t1".into())],
        };
        let body: Value =
            serde_json::from_slice(&sub_request(&r, &items, &[1], &keys, None)).unwrap();
        assert_eq!(
            body,
            json!({
                "model": "m",
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://x/1.png"}, "uuid": "u1"}
                ]}],
                "stream": false,
                "mm_processor_kwargs": {"fps": 2},
                "priority": 3,
            })
        );
        let pushed: Value =
            serde_json::from_slice(&sub_request(&r, &items, &[0, 1], &keys, Some("tcp://c:1")))
                .unwrap();
        assert_eq!(
            pushed[EC_TRANSFER_PARAMS],
            json!({"consumer_zmq": "tcp://c:1",
                   "ec_items": [{"transfer_id": "t0"}, {"transfer_id": "t1"}]})
        );
        assert_eq!(ec_params_of(b"<html>"), Map::new());
        assert_eq!(
            ec_params_of(br#"{"ec_transfer_params": {"h": {"metadata": {}}}}"#)["h"],
            json!({"metadata": {}})
        );
    }
}
