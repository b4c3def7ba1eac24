//! A request served as several through P/D, put back together as one worker would
//! answer it:
//! - a completions request with several prompts: each prompt is a request of its own
//!   (one prefill leg, one decode leg, its own KV handle), its `n` choices after those of
//!   the prompts before it, usage summed;
//! - a request with `n` > 1 under vLLM's protocol: one request per choice, choice `i`
//!   seeded `seed + i` (as vLLM and pdserve's engine seed a request's choices), the
//!   prompt counted once in the usage. vLLM's decode instance reads a prefill handle once
//!   per choice, and the prefill instance frees its blocks after the first read: the
//!   second choice would read blocks it no longer has.
//!
//! All parts run at once. A failure of any part is the request's answer; the other
//! parts' legs are dropped, which releases their prefill KV (see `ReleaseOnDrop`) and
//! cancels their decodes.

use std::future::Future;

use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use pdserve_protocol::{Prompt, Usage};
use serde_json::Value;

use crate::error::Failure;
use crate::ingress::request::ClientRequest;

/// The single-prompt requests of a completions request with more than one prompt.
pub fn split(request: &ClientRequest) -> Option<Vec<ClientRequest>> {
    let ClientRequest::Completion(completion) = request else {
        return None;
    };
    let prompts: Vec<Prompt> = match &completion.prompt {
        Prompt::Texts(texts) if texts.len() > 1 => {
            texts.iter().cloned().map(Prompt::Text).collect()
        }
        Prompt::TokenBatches(batches) if batches.len() > 1 => {
            batches.iter().cloned().map(Prompt::Tokens).collect()
        }
        _ => return None,
    };
    Some(
        prompts
            .into_iter()
            .map(|prompt| {
                let mut one = completion.clone();
                one.prompt = prompt;
                ClientRequest::Completion(one)
            })
            .collect(),
    )
}

/// The single-choice requests of a request with `n` > 1: `n` removed, and choice `i`
/// seeded `seed + i` when the client gave a seed.
pub fn split_choices(request: &ClientRequest) -> Option<Vec<ClientRequest>> {
    // `n` and `seed` are numbers the gateway forwards as written (held verbatim).
    let n = request
        .verbatim_number("n")?
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 1)?;
    let seed = request
        .verbatim_number("seed")
        .and_then(|s| s.parse::<i128>().ok());
    Some(
        (0..n)
            .map(|i| {
                let mut one = request.clone();
                let numbers = one.verbatim_numbers_mut();
                numbers.retain(|(name, _)| name != "n" && !(name == "seed" && seed.is_some()));
                if let Some(seed) = seed {
                    numbers.push(("seed".into(), (seed + i as i128).to_string()));
                }
                one
            })
            .collect(),
    )
}

/// What the parts of a split request are: it decides how their usage adds up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parts {
    /// One part per prompt of a completions batch: every count adds up.
    Prompts,
    /// One part per choice of one prompt: the prompt counts once.
    Choices,
}

impl Parts {
    /// Adds one part's usage into the total.
    fn add(self, total: &mut Usage, part: &Usage) {
        match self {
            Self::Prompts => total.add(part),
            Self::Choices => {
                total.completion_tokens += part.completion_tokens;
                total.total_tokens = total.prompt_tokens + total.completion_tokens;
            }
        }
    }
}

/// Serves `requests` (the parts, in order; `serve_one` gets each with its place) and
/// answers as one.
pub async fn serve<F, Fut>(
    requests: Vec<ClientRequest>,
    parts: Parts,
    serve_one: F,
) -> Result<Response, Failure>
where
    F: Fn(usize, ClientRequest) -> Fut,
    Fut: Future<Output = Result<Response, Failure>>,
{
    let stream = requests.first().is_some_and(ClientRequest::is_stream);
    let choices_each = match parts {
        Parts::Choices => 1,
        Parts::Prompts => requests
            .first()
            .and_then(|r| r.verbatim_number("n"))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(1)
            .max(1),
    };
    let answers = futures::future::try_join_all(
        requests
            .into_iter()
            .enumerate()
            .map(|(i, one)| serve_one(i, one)),
    )
    .await?;
    if let Some(failed) = answers.iter().position(|r| !r.status().is_success()) {
        return Ok(answers
            .into_iter()
            .nth(failed)
            .expect("position is in range"));
    }
    if stream {
        Ok(merge_streams(answers, choices_each, parts))
    } else {
        merge_bodies(answers, parts).await
    }
}

/// One JSON body from the prompts' bodies.
async fn merge_bodies(answers: Vec<Response>, parts_are: Parts) -> Result<Response, Failure> {
    let mut parts = None;
    let mut merged: Option<Value> = None;
    let mut usage: Option<Usage> = None;
    let mut next_index = 0u64;
    for answer in answers {
        let (head, body) = answer.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.map_err(|e| {
            pdserve_protocol::ApiError::bad_gateway(format!("a part's answer broke off: {e}"))
        })?;
        let mut value: Value = serde_json::from_slice(&bytes).map_err(|e| {
            pdserve_protocol::ApiError::bad_gateway(format!("a part's answer is not JSON: {e}"))
        })?;
        let choices = match value.get_mut("choices").and_then(Value::as_array_mut) {
            Some(choices) => std::mem::take(choices),
            None => Vec::new(),
        };
        let count = choices.len() as u64;
        let base = next_index;
        let choices = choices.into_iter().map(move |mut choice| {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            choice["index"] = Value::from(base + index);
            choice
        });
        next_index += count;
        if let Some(u) = value
            .get("usage")
            .and_then(|u| serde_json::from_value(u.clone()).ok())
        {
            match usage.as_mut() {
                Some(total) => parts_are.add(total, &u),
                None => usage = Some(u),
            }
        }
        match merged.as_mut() {
            Some(first) => {
                if let Some(all) = first.get_mut("choices").and_then(Value::as_array_mut) {
                    all.extend(choices);
                }
            }
            None => {
                value["choices"] = Value::Array(choices.collect());
                if let Some(object) = value.as_object_mut() {
                    // One handle per part: none stands for the whole.
                    object.remove("kv_transfer_params");
                }
                merged = Some(value);
                parts = Some(head);
            }
        }
    }
    let (Some(mut parts), Some(mut merged)) = (parts, merged) else {
        return Err(pdserve_protocol::ApiError::internal("a split request with no parts").into());
    };
    if let Some(usage) = usage {
        merged["usage"] = serde_json::to_value(usage).unwrap_or(Value::Null);
    }
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let body = serde_json::to_vec(&merged).unwrap_or_default();
    Ok(Response::from_parts(parts, Body::from(body)))
}

/// What one event of a prompt's stream becomes in the merged stream.
enum Event {
    /// Sent on, reindexed.
    Send(Vec<u8>),
    /// A usage event: summed into the one sent at the end.
    Usage(Value),
    /// An error event: sent, and the merged stream ends.
    Error(Vec<u8>),
    /// `[DONE]`: the merged stream sends its own at the end.
    Done,
}

/// Classifies one `data:` payload of a part's stream whose choices start at `offset`;
/// its `id` and `created` become the first event's (`first`), as in one worker's stream.
fn event(data: &[u8], offset: u64, first: &mut Option<(Value, Value)>) -> Event {
    if data.trim_ascii() == b"[DONE]" {
        return Event::Done;
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(data) else {
        return Event::Send(data.to_vec());
    };
    if value.get("error").is_some() {
        return Event::Error(data.to_vec());
    }
    if let Some(object) = value.as_object_mut() {
        let (id, created) = first.get_or_insert_with(|| {
            (
                object.get("id").cloned().unwrap_or(Value::Null),
                object.get("created").cloned().unwrap_or(Value::Null),
            )
        });
        for (key, same) in [("id", &*id), ("created", &*created)] {
            if object.contains_key(key) && !same.is_null() {
                object.insert(key.into(), same.clone());
            }
        }
    }
    let has_usage = value.get("usage").is_some_and(|u| !u.is_null());
    match value.get_mut("choices").and_then(Value::as_array_mut) {
        Some(choices) if choices.is_empty() && has_usage => {
            return Event::Usage(value);
        }
        Some(choices) => {
            for choice in choices {
                let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
                choice["index"] = Value::from(offset + index);
            }
        }
        None => {}
    }
    Event::Send(serde_json::to_vec(&value).unwrap_or_else(|_| data.to_vec()))
}

/// The merged state of the prompts' streams.
struct Streams {
    bodies: futures::stream::SelectAll<futures::stream::BoxStream<'static, (u64, Bytes)>>,
    usage: Option<(Value, Usage)>,
    /// The first event's `id` and `created`.
    first: Option<(Value, Value)>,
    parts: Parts,
}

/// One event stream from the prompts' streams: events as they come, reindexed, then the
/// summed usage event (when the prompts sent one) and one `[DONE]`.
fn merge_streams(answers: Vec<Response>, choices_each: usize, parts_are: Parts) -> Response {
    let mut parts = None;
    let mut bodies = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        let (head, body) = answer.into_parts();
        parts.get_or_insert(head);
        let offset = (i * choices_each) as u64;
        bodies.push(
            body.into_data_stream()
                .filter_map(|chunk| async move { chunk.ok() })
                .map(move |chunk| (offset, chunk))
                .boxed(),
        );
    }
    let state = Streams {
        bodies: futures::stream::select_all(bodies),
        usage: None,
        first: None,
        parts: parts_are,
    };
    let events = futures::stream::unfold(Some(state), |state| async move {
        let mut state = state?;
        loop {
            let Some((offset, chunk)) = state.bodies.next().await else {
                let mut out = BytesMut::new();
                if let Some((mut event, usage)) = state.usage.take() {
                    event["usage"] = serde_json::to_value(usage).unwrap_or(Value::Null);
                    out.extend_from_slice(&pdserve_protocol::sse::data_event(&event));
                }
                out.extend_from_slice(pdserve_protocol::sse::DONE);
                return Some((Ok::<_, std::convert::Infallible>(out.freeze()), None));
            };
            let mut out = BytesMut::new();
            for line in chunk.split(|&b| b == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let data = data.strip_prefix(b" ").unwrap_or(data);
                match event(data, offset, &mut state.first) {
                    Event::Send(json) => {
                        out.extend_from_slice(b"data: ");
                        out.extend_from_slice(&json);
                        out.extend_from_slice(b"\n\n");
                    }
                    Event::Usage(value) => {
                        let Some(usage) = value
                            .get("usage")
                            .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok())
                        else {
                            continue;
                        };
                        match state.usage.as_mut() {
                            Some((_, total)) => state.parts.add(total, &usage),
                            None => state.usage = Some((value, usage)),
                        }
                    }
                    Event::Error(json) => {
                        out.extend_from_slice(b"data: ");
                        out.extend_from_slice(&json);
                        out.extend_from_slice(b"\n\n");
                        out.extend_from_slice(pdserve_protocol::sse::DONE);
                        // No state: the other prompts' streams are dropped (cancelled).
                        return Some((Ok(out.freeze()), None));
                    }
                    Event::Done => {}
                }
            }
            if !out.is_empty() {
                return Some((Ok(out.freeze()), Some(state)));
            }
        }
    });
    let mut parts = parts.expect("a split request has parts");
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from_stream(events))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use serde_json::json;

    fn parse(body: Value) -> ClientRequest {
        ClientRequest::parse(Endpoint::Completions, body.to_string().as_bytes())
            .unwrap()
            .0
    }

    #[test]
    fn only_several_prompts_split() {
        let parts = split(&parse(json!({"prompt": ["a", "b"], "n": 2}))).unwrap();
        assert_eq!(parts.len(), 2);
        let ClientRequest::Completion(second) = &parts[1] else {
            panic!()
        };
        assert_eq!(second.prompt, Prompt::Text("b".into()));
        assert_eq!(parts[1].verbatim_number("n"), Some("2"));
        assert!(split(&parse(json!({"prompt": [[1, 2], [3]]}))).is_some());
        assert!(split(&parse(json!({"prompt": ["a"]}))).is_none());
        assert!(split(&parse(json!({"prompt": [1, 2]}))).is_none());
    }

    #[test]
    fn stream_events_are_reindexed_and_usage_held_back() {
        let mut first = None;
        let chunk = json!({"id": "a", "created": 1, "choices": [{"index": 1, "text": "x"}]});
        match event(chunk.to_string().as_bytes(), 4, &mut first) {
            Event::Send(json) => {
                let v: Value = serde_json::from_slice(&json).unwrap();
                assert_eq!(v["choices"][0]["index"], 5);
            }
            _ => panic!("a choice chunk is sent"),
        }
        // A later part's events carry the first event's id and creation time.
        let other = json!({"id": "b", "created": 2, "choices": [{"index": 0, "text": "y"}]});
        match event(other.to_string().as_bytes(), 1, &mut first) {
            Event::Send(json) => {
                let v: Value = serde_json::from_slice(&json).unwrap();
                assert_eq!((&v["id"], &v["created"]), (&json!("a"), &json!(1)));
                assert_eq!(v["choices"][0]["index"], 1);
            }
            _ => panic!("a choice chunk is sent"),
        }
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 1}}).to_string();
        assert!(matches!(
            event(usage.as_bytes(), 0, &mut first),
            Event::Usage(_)
        ));
        assert!(matches!(event(b"[DONE]", 0, &mut first), Event::Done));
        let error = json!({"error": {"message": "x"}}).to_string();
        assert!(matches!(
            event(error.as_bytes(), 0, &mut first),
            Event::Error(_)
        ));
    }

    fn parse_chat(body: Value) -> ClientRequest {
        ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
            .unwrap()
            .0
    }

    #[test]
    fn choices_split_one_request_per_choice_seeded_in_turn() {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 7});
        let parts = split_choices(&parse_chat(body)).unwrap();
        assert_eq!(parts.len(), 3);
        for (i, part) in parts.iter().enumerate() {
            assert_eq!(part.verbatim_number("n"), None);
            assert_eq!(
                part.verbatim_number("seed"),
                Some((7 + i).to_string().as_str())
            );
        }
        // No seed: none is made up; one choice or none: no split.
        let unseeded = json!({"messages": [{"role": "user", "content": "hi"}], "n": 2});
        let parts = split_choices(&parse_chat(unseeded)).unwrap();
        assert!(parts.iter().all(|p| p.verbatim_number("seed").is_none()));
        assert!(split_choices(&parse(json!({"prompt": "a", "n": 1}))).is_none());
        assert!(split_choices(&parse(json!({"prompt": "a"}))).is_none());
    }

    #[test]
    fn a_choice_split_counts_the_prompt_once() {
        let mut total = Usage::new(10, 3, 4);
        Parts::Choices.add(&mut total, &Usage::new(10, 5, 4));
        assert_eq!(
            (
                total.prompt_tokens,
                total.completion_tokens,
                total.total_tokens
            ),
            (10, 8, 18)
        );
        let mut total = Usage::new(10, 3, 0);
        Parts::Prompts.add(&mut total, &Usage::new(6, 5, 0));
        assert_eq!((total.prompt_tokens, total.total_tokens), (16, 24));
    }
}
