//! D's relayed stream with P's outcome attached: D's bytes go to the client as they
//! come, its `[DONE]` is held until P answered, and P's failure ends the stream with an
//! error event.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};

use super::prefill_leg::PrefillLeg;
use pdserve_protocol::ApiError;

use crate::clients::worker_client::{LegError, LegFault};
use crate::legs::prompt_logprobs::PrefillLogprobs;
use crate::legs::sse::StreamDialect;
use crate::serving::ServingMetrics;

/// D's relayed stream with P's outcome attached.
pub(super) struct Attached {
    pub(super) relay: Option<BoxStream<'static, Result<Bytes, Infallible>>>,
    /// P, while it has not answered.
    pub(super) prefill: Option<PrefillLeg>,
    pub(super) merge: Option<PrefillLogprobs>,
    /// D's `[DONE]` (and anything after it), held until P answered.
    pub(super) held: Option<Bytes>,
    /// Whether everything sent so far ends at an event boundary.
    pub(super) at_boundary: bool,
    /// How the stream ends and fails.
    pub(super) dialect: StreamDialect,
    pub(super) metrics: Arc<ServingMetrics>,
}

/// What happened next while streaming.
enum Step {
    Prefill(Option<LegError>),
    Relay(Option<Result<Bytes, Infallible>>),
}

impl Attached {
    pub(super) fn into_stream(
        self,
    ) -> Pin<Box<dyn Stream<Item = Result<Bytes, Infallible>> + Send>> {
        Box::pin(futures::stream::unfold(self, |mut this| async move {
            let chunk = this.next_chunk().await?;
            Some((Ok(chunk), this))
        }))
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if let Some(held) = self.held.take() {
                let failure = match self.prefill.as_mut() {
                    Some(p) => p.failure().await,
                    None => None,
                };
                self.prefill = None;
                return Some(match failure {
                    None => held,
                    Some(e) => self.prefill_failed(e),
                });
            }
            let pending = self.prefill.is_some();
            let step = {
                let relay = self.relay.as_mut()?;
                let prefill = &mut self.prefill;
                tokio::select! {
                    biased;
                    failure = async { prefill.as_mut().expect("pending").failure().await },
                        if pending => Step::Prefill(failure),
                    item = relay.next() => Step::Relay(item),
                }
            };
            let chunk = match step {
                Step::Prefill(None) => {
                    self.prefill = None;
                    continue;
                }
                Step::Prefill(Some(e)) => return Some(self.prefill_failed(e)),
                Step::Relay(None) => {
                    self.relay = None;
                    return None;
                }
                Step::Relay(Some(Ok(chunk))) => chunk,
            };
            let chunk = match &self.merge {
                Some(merge) => merge.merge_events(chunk),
                None => chunk,
            };
            if self.prefill.is_some() {
                if let Some(at) = self.dialect.end_at(&chunk) {
                    if memchr::memmem::find(&chunk[..at], b"data: {\"error\"").is_some() {
                        // D failed: its error ends the stream, and P is no longer needed.
                        self.prefill = None;
                    } else {
                        self.held = Some(chunk.slice(at..));
                        if at == 0 {
                            continue;
                        }
                        let before = chunk.slice(..at);
                        self.at_boundary = ends_event(&before);
                        return Some(before);
                    }
                }
            }
            self.at_boundary = ends_event(&chunk);
            return Some(chunk);
        }
    }

    /// Ends the stream after P failed: D is dropped (its connection closed), and an error
    /// event and `[DONE]` follow what was sent.
    fn prefill_failed(&mut self, e: LegError) -> Bytes {
        self.relay = None;
        self.held = None;
        let message = format!(
            "prefill worker failed after the decode worker started streaming: {}",
            e.failure_message()
        );
        tracing::warn!("{message}");
        let error = if e.kind == LegFault::TimedOut {
            ApiError::gateway_timeout(message)
        } else {
            ApiError::bad_gateway(message)
        };
        self.metrics.inc_stream_errors();
        self.dialect.error_tail(&error, self.at_boundary)
    }
}

fn ends_event(chunk: &[u8]) -> bool {
    chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_is_found_only_at_a_line_start() {
        let done_line = |chunk: &[u8]| StreamDialect::Chat.end_at(chunk);
        assert_eq!(done_line(b"data: {}\n\ndata: [DONE]\n\n"), Some(10));
        assert_eq!(done_line(b"data: [DONE]\n\n"), Some(0));
        assert_eq!(done_line(b"data: {\"t\":\"data: [DONE]\"}\n\n"), None);
        let responses = |chunk: &[u8]| StreamDialect::Responses.end_at(chunk);
        let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"response.completed\"}\n\n";
        assert_eq!(responses(delta), None);
        let mut both = delta.to_vec();
        both.extend_from_slice(
            b"event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
        );
        assert_eq!(responses(&both), Some(delta.len()));
        assert_eq!(
            responses(b"data: {\"type\":\"response.incomplete\",\"response\":{}}\n\n"),
            Some(0)
        );
    }
}
