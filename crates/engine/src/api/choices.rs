//! Parallel sampling (`n`): a request's choices, each a sequence of its own, answered as
//! one OpenAI response (`choices` indexed 0..n, completion tokens summed, the prompt
//! counted once) or one event stream (chunks tagged with their choice's `index`, a
//! finish chunk per choice, usage once after the last).

use std::ops::Range;
use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use pdserve_protocol::{ApiError, KvTransferParams, Usage};

use super::body::sse_response;
use super::response_format::{Generation, Piece, ResponseFormat};

pub use crate::serving::output::ChoiceOutput;
pub use crate::serving::submission::{choice_request, Submitted};

/// The usage of a whole answer from its generations' (in index order), `prompts` prompts
/// of equally many generations each: per prompt as [`prompt_usage`], summed.
pub fn merged_usage(usages: &[Usage], prompts: usize) -> Usage {
    let per = usages.len() / prompts.max(1);
    let mut groups = usages.chunks(per.max(1)).map(prompt_usage);
    let mut total = groups.next().unwrap_or_else(|| Usage::new(0, 0, 0));
    for usage in groups {
        total.add(&usage);
    }
    total
}

/// The usage of one prompt's choices: the prompt counted once, as choice 0 saw it (its
/// cached and imported tokens), completion tokens summed.
pub fn prompt_usage(usages: &[Usage]) -> Usage {
    let Some(first) = usages.first() else {
        return Usage::new(0, 0, 0);
    };
    let completion: u64 = usages.iter().map(|u| u.completion_tokens).sum();
    Usage {
        completion_tokens: completion,
        total_tokens: first.prompt_tokens + completion,
        ..first.clone()
    }
}

/// What one choice's stream tells the merged stream.
enum ChoiceEvent {
    /// A chunk to send.
    Chunk(Bytes),
    /// The choice's finish chunk, and its usage; `count` choices from `index` on end
    /// with it (a prefill's one output standing for every choice).
    End {
        index: usize,
        count: usize,
        chunk: Bytes,
        usage: Usage,
    },
    /// The choice failed: the whole answer ends with this error.
    Failed(ApiError),
}

/// The chunks of the choices `indexes` (one, unless one output stands for several):
/// one per token with text (or with a logprob), then the finish chunk, each repeated
/// for every index.
fn choice_events<F: ResponseFormat>(
    indexes: Range<usize>,
    generation: Generation,
    format: Arc<F>,
) -> BoxStream<'static, ChoiceEvent> {
    let (index, count) = (indexes.start, indexes.len());
    let each = move |chunk: &dyn Fn(u32) -> Bytes| -> Bytes {
        let mut out = BytesMut::new();
        for i in indexes.clone() {
            out.extend_from_slice(&chunk(i as u32));
        }
        out.freeze()
    };
    futures::stream::unfold(Some(generation), move |state| {
        let format = format.clone();
        let each = each.clone();
        async move {
            let mut generation = state?;
            loop {
                let event = match generation.next().await? {
                    Piece::Prompt(prompt) => {
                        let chunks = each(&|i| format.prompt_chunk(i, &prompt).unwrap_or_default());
                        if chunks.is_empty() {
                            continue;
                        }
                        ChoiceEvent::Chunk(chunks)
                    }
                    Piece::Token { text, logprob, .. } => {
                        if text.is_empty() && logprob.is_none() {
                            continue;
                        }
                        ChoiceEvent::Chunk(each(&|i| {
                            format.text_chunk(i, text.clone(), logprob.clone())
                        }))
                    }
                    Piece::Tail(text) => {
                        ChoiceEvent::Chunk(each(&|i| format.text_chunk(i, text.clone(), None)))
                    }
                    Piece::End {
                        finish_reason,
                        usage,
                        kv_transfer_params,
                    } => {
                        let chunk = each(&|i| {
                            format.finish_chunk(i, finish_reason, kv_transfer_params.clone())
                        });
                        return Some((
                            ChoiceEvent::End {
                                index,
                                count,
                                chunk,
                                usage,
                            },
                            None,
                        ));
                    }
                    Piece::Error(e) => return Some((ChoiceEvent::Failed(e), None)),
                };
                return Some((event, Some(generation)));
            }
        }
    })
    .boxed()
}

/// The merged stream's state between events.
struct Merged {
    choices: SelectAll<BoxStream<'static, ChoiceEvent>>,
    usages: Vec<Option<Usage>>,
    remaining: usize,
}

/// Streams the choices as server-sent events: each choice's start chunk, then every
/// choice's chunks as they come, each choice's finish chunk when it ends, the usage
/// chunk if asked once all have ended, then `[DONE]`. A failed choice ends the stream
/// with an error event. Dropping the stream (client gone) drops every choice's
/// receiver, which cancels them. One generation for several choices is sent as each.
pub fn stream_response<F: ResponseFormat>(
    submitted: Submitted,
    format: F,
    include_usage: bool,
) -> Response {
    let format = Arc::new(format);
    let n = submitted.choices;
    let prompts = submitted.prompts;
    let per = n / submitted.generations.len().max(1);
    let starts: Vec<Bytes> = (0..n as u32)
        .filter_map(|i| format.start_chunk(i))
        .collect();
    let merged = Merged {
        choices: futures::stream::select_all(
            submitted
                .generations
                .into_iter()
                .enumerate()
                .map(|(i, g)| choice_events(i * per..(i + 1) * per, g, format.clone())),
        ),
        usages: vec![None; n],
        remaining: n,
    };
    let rest = futures::stream::unfold(Some(merged), move |state| {
        let format = format.clone();
        async move {
            let mut merged = state?;
            match merged.choices.next().await? {
                ChoiceEvent::Chunk(chunk) => Some((chunk, Some(merged))),
                ChoiceEvent::End {
                    index,
                    count,
                    chunk,
                    usage,
                } => {
                    merged.usages[index] = Some(usage);
                    merged.remaining -= count;
                    if merged.remaining > 0 {
                        return Some((chunk, Some(merged)));
                    }
                    let mut out = BytesMut::from(&chunk[..]);
                    if include_usage {
                        let usages: Vec<Usage> = merged.usages.drain(..).flatten().collect();
                        let usage = merged_usage(&usages, prompts);
                        out.extend_from_slice(&format.usage_chunk(usage));
                    }
                    out.extend_from_slice(format.end_chunk());
                    Some((out.freeze(), None))
                }
                ChoiceEvent::Failed(e) => {
                    tracing::warn!("stream ended by an engine error: {e}");
                    // Returning no state drops the other choices, which cancels them.
                    Some((format.error_chunk(&e), None))
                }
            }
        }
    });
    let events = futures::stream::iter(starts).chain(rest);
    sse_response(events.map(Ok::<_, std::convert::Infallible>))
}

/// Runs one choice to its end.
async fn collect_choice(
    mut generation: Generation,
    want_logprobs: bool,
    want_token_ids: bool,
) -> Result<(ChoiceOutput, Usage, Option<KvTransferParams>), ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    let mut token_ids = Vec::new();
    let mut prompt = None;
    while let Some(piece) = generation.next().await {
        match piece {
            Piece::Prompt(p) => prompt = Some(p),
            Piece::Token {
                id,
                text: t,
                logprob,
            } => {
                text.push_str(&t);
                logprobs.extend(logprob);
                if want_token_ids {
                    token_ids.push(id);
                }
            }
            Piece::Tail(t) => text.push_str(&t),
            Piece::End {
                finish_reason,
                usage,
                kv_transfer_params,
            } => {
                let output = ChoiceOutput {
                    prompt,
                    text,
                    logprobs: want_logprobs.then_some(logprobs),
                    token_ids: want_token_ids.then_some(token_ids),
                    finish_reason,
                };
                return Ok((output, usage, kv_transfer_params));
            }
            Piece::Error(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

/// Runs every choice to its end and answers one JSON response; the first failed choice
/// answers its error instead (the others are dropped, which cancels them). One
/// generation for several choices is listed as each (its usage counted once).
pub async fn collect_response<F: ResponseFormat>(
    submitted: Submitted,
    format: F,
    want_logprobs: bool,
    want_token_ids: bool,
) -> Response {
    let per = submitted.choices / submitted.generations.len().max(1);
    let prompts = submitted.prompts;
    let runs = submitted
        .generations
        .into_iter()
        .map(|g| collect_choice(g, want_logprobs, want_token_ids));
    let finished = match futures::future::try_join_all(runs).await {
        Ok(finished) => finished,
        Err(e) => return e.into_response(),
    };
    let mut outputs = Vec::with_capacity(finished.len());
    let mut usages = Vec::with_capacity(finished.len());
    let mut kv_transfer_params = None;
    for (output, usage, params) in finished {
        outputs.extend(std::iter::repeat_n(output, per));
        usages.push(usage);
        // Only one choice publishes KV (choice 0, or a prefill's one output).
        kv_transfer_params = kv_transfer_params.or(params);
    }
    format.response(outputs, merged_usage(&usages, prompts), kv_transfer_params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::GenerationRequest;
    use crate::sampling::SamplingParams;

    #[test]
    fn choices_derive_their_seeds_from_the_request_seed() {
        let mut request = GenerationRequest::new(vec![1, 2, 3], 4);
        assert_eq!(choice_request(&request, 3).sampling.seed, None);
        request.sampling = SamplingParams {
            seed: Some(u64::MAX),
            ..SamplingParams::greedy()
        };
        let seeds: Vec<_> = (0..3)
            .map(|i| choice_request(&request, i).sampling.seed)
            .collect();
        assert_eq!(seeds, [Some(u64::MAX), Some(0), Some(1)]);
    }

    #[test]
    fn usage_counts_the_prompt_once_and_sums_completions() {
        let usage = merged_usage(
            &[
                Usage::new(10, 4, 0).with_sources(0, 9),
                Usage::new(10, 6, 8),
                Usage::new(10, 1, 8),
            ],
            1,
        );
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens
            ),
            (10, 11, 21)
        );
        assert_eq!(usage.prompt_tokens_details.unwrap().cached_tokens, 0);
        assert_eq!(usage.pdserve.unwrap().kv_imported_tokens, 9);
    }

    #[test]
    fn a_batch_sums_its_prompts_usages() {
        let usage = merged_usage(
            &[
                Usage::new(10, 4, 0),
                Usage::new(10, 6, 8),
                Usage::new(7, 1, 5).with_sources(2, 0),
                Usage::new(7, 2, 5),
            ],
            2,
        );
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens
            ),
            (17, 13, 30)
        );
        assert_eq!(usage.prompt_tokens_details.unwrap().cached_tokens, 5);
        assert_eq!(usage.pdserve.unwrap().earlier_turn_tokens, 2);
    }
}
