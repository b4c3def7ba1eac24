//! A completions request with several prompts through P/D: each prompt is a request of
//! its own (one prefill leg, one decode leg, its own KV handle), all run at once, and
//! the answers are put back together in prompt order — choices reindexed (prompt `i`'s
//! `n` choices after those of the prompts before it), usage summed — as one worker
//! answers a batch. A failure of any prompt is the request's answer; the other prompts'
//! legs are dropped, which releases their prefill KV (see `ReleaseOnDrop`) and cancels
//! their decodes.

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

/// Serves `requests` (a batch's prompts, in order) with `serve_one` and answers as one.
pub async fn serve<F, Fut>(requests: Vec<ClientRequest>, serve_one: F) -> Result<Response, Failure>
where
    F: Fn(ClientRequest) -> Fut,
    Fut: Future<Output = Result<Response, Failure>>,
{
    let stream = requests.first().is_some_and(ClientRequest::is_stream);
    // `n` is a number the gateway forwards as written (held verbatim).
    let choices_each = requests
        .first()
        .and_then(|r| r.verbatim_number("n"))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let answers = futures::future::try_join_all(requests.into_iter().map(serve_one)).await?;
    if let Some(failed) = answers.iter().position(|r| !r.status().is_success()) {
        return Ok(answers
            .into_iter()
            .nth(failed)
            .expect("position is in range"));
    }
    if stream {
        Ok(merge_streams(answers, choices_each))
    } else {
        merge_bodies(answers).await
    }
}

/// One JSON body from the prompts' bodies.
async fn merge_bodies(answers: Vec<Response>) -> Result<Response, Failure> {
    let mut parts = None;
    let mut merged: Option<Value> = None;
    let mut usage: Option<Usage> = None;
    let mut next_index = 0u64;
    for answer in answers {
        let (head, body) = answer.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.map_err(|e| {
            pdserve_protocol::ApiError::bad_gateway(format!(
                "a batch prompt's answer broke off: {e}"
            ))
        })?;
        let mut value: Value = serde_json::from_slice(&bytes).map_err(|e| {
            pdserve_protocol::ApiError::bad_gateway(format!(
                "a batch prompt's answer is not JSON: {e}"
            ))
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
                Some(total) => total.add(&u),
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
                    // One handle per prompt: none stands for the batch.
                    object.remove("kv_transfer_params");
                }
                merged = Some(value);
                parts = Some(head);
            }
        }
    }
    let (Some(mut parts), Some(mut merged)) = (parts, merged) else {
        return Err(pdserve_protocol::ApiError::internal("a batch with no prompts").into());
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

/// Classifies one `data:` payload of prompt stream `prompt`.
fn event(data: &[u8], offset: u64) -> Event {
    if data.trim_ascii() == b"[DONE]" {
        return Event::Done;
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(data) else {
        return Event::Send(data.to_vec());
    };
    if value.get("error").is_some() {
        return Event::Error(data.to_vec());
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
}

/// One event stream from the prompts' streams: events as they come, reindexed, then the
/// summed usage event (when the prompts sent one) and one `[DONE]`.
fn merge_streams(answers: Vec<Response>, choices_each: usize) -> Response {
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
                match event(data, offset) {
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
                            Some((_, total)) => total.add(&usage),
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
    let mut parts = parts.expect("a batch has prompts");
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
        let chunk = json!({"choices": [{"index": 1, "text": "x"}]}).to_string();
        match event(chunk.as_bytes(), 4) {
            Event::Send(json) => {
                let v: Value = serde_json::from_slice(&json).unwrap();
                assert_eq!(v["choices"][0]["index"], 5);
            }
            _ => panic!("a choice chunk is sent"),
        }
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 1}}).to_string();
        assert!(matches!(event(usage.as_bytes(), 0), Event::Usage(_)));
        assert!(matches!(event(b"[DONE]", 0), Event::Done));
        let error = json!({"error": {"message": "x"}}).to_string();
        assert!(matches!(event(error.as_bytes(), 0), Event::Error(_)));
    }
}
