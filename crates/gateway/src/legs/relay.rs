//! Relays a worker's SSE stream to the client chunk by chunk, while watching it for the
//! end marker and the decode side's final `kv_transfer_params`. Chat and completion
//! streams end with `data: [DONE]`; a Responses stream ends with its `response.completed`
//! (or `incomplete`, `failed`) event, whose response objects the gateway edits on the way
//! ([`ResponseObjects`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::{FutureExt, Stream, StreamExt};
use pdserve_protocol::ApiError;

use crate::error::error_chain;
use crate::observe::journey::Journey;
use crate::observe::request_record::Finished;
use crate::policy::InFlight;
use crate::policy::RequestOutcome;
use crate::serving::ServingMetrics;

use super::sse::*;
pub use crate::clients::worker_client::{ByteStream, StreamError};

/// Everything a relay needs besides the upstream stream.
pub struct Relay {
    /// The already received first chunk.
    pub first: Bytes,
    /// The rest of the upstream body.
    pub upstream: ByteStream,
    /// The upstream is decoded on another task (reqwest's connection task), which needs
    /// a turn before the relay decides that nothing more has arrived; a direct
    /// connection is decoded by polling the stream itself.
    pub decoded_elsewhere: bool,
    /// Longest silence between chunks.
    pub idle_timeout: Duration,
    /// Where the final KV params (or a Responses answer's objects) go.
    pub sink: Option<AnswerSink>,
    /// Metrics to record the outcome in.
    pub metrics: Arc<ServingMetrics>,
    /// Route label for the end-to-end histogram.
    pub route: &'static str,
    /// When the client request arrived.
    pub started: Instant,
    /// The worker's base URL, for logs.
    pub worker: String,
    /// The request id, for logs.
    pub request_id: String,
    /// Keeps the worker's in-flight count until the relay ends or is dropped.
    pub in_flight: InFlight,
    /// The request's route, filed for the dashboard when the stream ends.
    pub journey: Option<Arc<Journey>>,
    /// The answering leg's span, ended when the relay is dropped (traced requests only).
    pub trace: Option<pdserve_telemetry::ChildSpan>,
    /// The first tokens the client already got from the prefill leg: taken out of this
    /// stream when it generates them again, a mismatch ends it.
    pub first_token: Option<super::first_token_guard::FirstTokenGuard>,
}

/// The relay's running state.
struct RelayState {
    relay: Relay,
    scanner: SseScanner,
    first: Option<Bytes>,
    /// A failure or end seen while merging, reported after the merged bytes.
    stashed: Option<End>,
    finished: bool,
    /// For the dashboard: when the relay began (the first chunk had just come), when
    /// the client got its first bytes, and the upstream chunks (the first included).
    opened: Instant,
    first_out: Option<Instant>,
    chunks: u32,
}

impl Relay {
    /// The client body: upstream bytes as they arrive, then (on failure) an error event.
    /// Dropping it (the client went away) drops the upstream response, which closes the
    /// connection to the worker and so cancels its request.
    pub fn into_stream(mut self) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
        let scanner = match &self.sink {
            Some(AnswerSink::Responses(objects)) => {
                SseScanner::responses(Some(objects.clone()), self.worker.clone())
            }
            Some(AnswerSink::Conversation { .. }) => SseScanner::new(true),
            None => SseScanner::new(false),
        };
        let first = Some(std::mem::take(&mut self.first));
        let opened = Instant::now();
        let state = RelayState {
            relay: self,
            scanner,
            first,
            stashed: None,
            finished: false,
            opened,
            first_out: None,
            chunks: 0,
        };
        futures::stream::unfold(state, |mut state| async move {
            let item = state.next_chunk().await?;
            state.first_out.get_or_insert_with(Instant::now);
            Some((Ok(item), state))
        })
    }
}

/// What the upstream produced next.
enum Event {
    Chunk(Bytes),
    End(End),
}

/// How the upstream stream stopped.
enum End {
    /// Cleanly (a success only if `[DONE]` was seen).
    Closed,
    /// With a transport error.
    Failed(StreamError),
    /// With bytes that are not an event stream.
    Malformed(String),
    /// Silent past the idle timeout.
    Idle,
    /// Did not continue from the first token the prefill leg gave the client.
    Mismatch(super::first_token_guard::Mismatch),
}

impl From<Option<Result<Bytes, StreamError>>> for Event {
    fn from(next: Option<Result<Bytes, StreamError>>) -> Self {
        match next {
            Some(Ok(chunk)) => Self::Chunk(chunk),
            Some(Err(e)) => Self::End(End::Failed(e)),
            None => Self::End(End::Closed),
        }
    }
}

/// Most bytes merged into one client chunk.
const MAX_MERGED_BYTES: usize = 64 * 1024;

impl RelayState {
    /// The next bytes for the client: everything the upstream has delivered by now (whole
    /// lines only), merged so that a burst of events costs one write, never waiting for
    /// more than the first of them.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        let mut out: Option<Bytes> = None;
        let mut merged = BytesMut::new();
        loop {
            if self.finished {
                break;
            }
            let have_output = out.is_some() || !merged.is_empty();
            let event = if let Some(first) = self.first.take() {
                Event::Chunk(first)
            } else if let Some(end) = self.stashed.take() {
                Event::End(end)
            } else if have_output {
                // Only what is already there: the client gets what we hold without delay.
                // The HTTP client decodes each upstream chunk on its connection task, so
                // give that task one turn before deciding that nothing more has arrived.
                match self.relay.upstream.next().now_or_never() {
                    Some(next) => Event::from(next),
                    None if !self.relay.decoded_elsewhere => break,
                    None => {
                        tokio::task::yield_now().await;
                        match self.relay.upstream.next().now_or_never() {
                            Some(next) => Event::from(next),
                            None => break,
                        }
                    }
                }
            } else {
                self.wait().await
            };
            if matches!(event, Event::Chunk(_)) {
                self.chunks += 1;
            }
            let lines = match event {
                Event::Chunk(chunk) => match self.scanner.push(chunk) {
                    Ok(Some(lines)) => match &mut self.relay.first_token {
                        None => Ok(lines),
                        Some(guard) => match guard.filter(lines) {
                            Ok(lines) if lines.is_empty() => continue,
                            Ok(lines) => Ok(lines),
                            Err(mismatch) => Err(End::Mismatch(mismatch)),
                        },
                    },
                    Ok(None) => continue,
                    Err(msg) => Err(End::Malformed(msg)),
                },
                Event::End(end) => Err(end),
            };
            match lines {
                Ok(lines) => {
                    self.store_kv();
                    if self.scanner.saw_done {
                        // The terminal event waits until the finished response is kept.
                        if let Some(AnswerSink::Responses(objects)) = &self.relay.sink {
                            objects.flush().await;
                        }
                    }
                    match out.take() {
                        None if merged.is_empty() => out = Some(lines),
                        previous => {
                            if let Some(previous) = previous {
                                merged.extend_from_slice(&previous);
                            }
                            merged.extend_from_slice(&lines);
                        }
                    }
                    if merged.len() >= MAX_MERGED_BYTES {
                        break;
                    }
                }
                Err(end) if have_output => {
                    // Deliver what we hold first; the failure or end comes next time.
                    self.stashed = Some(end);
                    break;
                }
                Err(end) => return self.conclude(end),
            }
        }
        if merged.is_empty() {
            out
        } else {
            Some(merged.freeze())
        }
    }

    /// Waits for the upstream's next event, at most the idle timeout.
    async fn wait(&mut self) -> Event {
        let next = self.relay.upstream.next();
        match tokio::time::timeout(self.relay.idle_timeout, next).await {
            Ok(next) => Event::from(next),
            Err(_) => Event::End(End::Idle),
        }
    }

    /// The end of the relay: nothing more on success, else an error event.
    fn conclude(&mut self, end: End) -> Option<Bytes> {
        let worker = &self.relay.worker;
        let error = match end {
            End::Closed => return self.end_of_upstream(),
            End::Failed(e) => ApiError::bad_gateway(format!(
                "decode worker {worker} failed mid-stream: {}",
                error_chain(&*e)
            )),
            End::Malformed(msg) => ApiError::bad_gateway(format!(
                "decode worker {worker} sent a malformed stream: {msg}"
            )),
            End::Idle => ApiError::gateway_timeout(format!(
                "decode worker {worker} sent nothing for {:?}",
                self.relay.idle_timeout
            )),
            End::Mismatch(mismatch) => {
                self.relay.metrics.inc_first_token_mismatch();
                ApiError::bad_gateway(format!(
                    "decode worker {worker} did not continue from the first token sent: {mismatch}"
                ))
            }
        };
        Some(self.fail(error))
    }

    fn store_kv(&mut self) {
        if let (Some(kv), Some(AnswerSink::Conversation { cache, id })) =
            (self.scanner.kv.take(), &self.relay.sink)
        {
            cache.put(id, kv);
        }
    }

    fn end_of_upstream(&mut self) -> Option<Bytes> {
        if self.scanner.saw_done {
            self.finished = true;
            self.relay.in_flight.set_outcome(RequestOutcome::Success);
            self.record_end();
            self.file(200, "ok");
            return None;
        }
        let end = match self.scanner.dialect() {
            StreamDialect::Chat => "[DONE]",
            StreamDialect::Responses => "its response.completed event",
        };
        let msg = format!(
            "decode worker {} ended the stream without {end}",
            self.relay.worker
        );
        Some(self.fail(ApiError::bad_gateway(msg)))
    }

    fn fail(&mut self, error: ApiError) -> Bytes {
        tracing::warn!(request_id = %self.relay.request_id, "{}", error.body.error.message);
        self.finished = true;
        self.relay.in_flight.set_outcome(RequestOutcome::Failure);
        self.relay.metrics.inc_stream_errors();
        self.record_end();
        self.file(error.status.as_u16(), "stream_error");
        self.scanner.error_tail(&error)
    }

    fn record_end(&self) {
        self.relay
            .metrics
            .observe_end_to_end(self.relay.route, self.relay.started.elapsed());
    }

    /// Files the request for the dashboard: `status` is what the client's stream ended
    /// with (200 unless it failed), `outcome` how.
    fn file(&self, status: u16, outcome: &'static str) {
        let Some(journey) = &self.relay.journey else {
            return;
        };
        let started = journey.started();
        // Mean gap between chunks after the first: one event per token on the workers'
        // streams, so close to the inter-token latency (a burst merged upstream counts
        // once). A stream that ended well is filed as its last chunk is relayed.
        let itl = (outcome == "ok" && self.chunks >= 2)
            .then(|| self.opened.elapsed() / (self.chunks - 1));
        journey.file(
            self.relay.metrics.history(),
            Finished {
                status,
                outcome,
                stream: true,
                // A stream led by the prefill's token began before this relay's first.
                ttft: journey
                    .first_byte()
                    .or(self.first_out)
                    .map(|t| t.saturating_duration_since(started)),
                itl,
                duration: started.elapsed(),
            },
        );
    }
}

impl Drop for RelayState {
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!(
                request_id = %self.relay.request_id,
                worker = %self.relay.worker,
                "client went away mid-stream; cancelling the upstream request"
            );
            // nginx's "client closed request".
            self.file(499, "client_left");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_protocol::sse::DONE;

    fn relay(first: &'static [u8], rest: Vec<&'static [u8]>) -> Relay {
        let metrics = Arc::new(ServingMetrics::register(
            &mut prometheus_client::registry::Registry::default(),
            Arc::default(),
        ));
        let url = reqwest::Url::parse("http://127.0.0.1:9").unwrap();
        let spec =
            crate::fleet::registry::WorkerSpec::new(pdserve_protocol::WorkerRole::Decode, url);
        let worker = Arc::new(crate::fleet::registry::Worker::new(
            spec,
            Default::default(),
        ));
        let chunks: Vec<Result<Bytes, StreamError>> = rest
            .into_iter()
            .map(|c| Ok(Bytes::from_static(c)))
            .collect();
        Relay {
            first: Bytes::from_static(first),
            upstream: futures::stream::iter(chunks).boxed(),
            decoded_elsewhere: false,
            idle_timeout: Duration::from_secs(5),
            sink: None,
            metrics,
            route: "/v1/completions",
            started: Instant::now(),
            worker: "w".into(),
            request_id: "r".into(),
            in_flight: InFlight::start(worker, crate::policy::by_name("round_robin").unwrap()),
            journey: None,
            trace: None,
            first_token: None,
        }
    }

    #[tokio::test]
    async fn merges_chunks_that_are_already_there() {
        let out: Vec<Bytes> = relay(b"data: 1\n\n", vec![b"data: 2\n\nda", b"ta: [DONE]\n\n"])
            .into_stream()
            .map(|c| c.unwrap())
            .collect()
            .await;
        assert_eq!(
            out,
            vec![Bytes::from_static(
                b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            )]
        );
    }

    #[tokio::test]
    async fn a_stream_without_done_ends_with_an_error_event() {
        let out: Vec<Bytes> = relay(b"data: 1\n\n", vec![b"data: 2\n"])
            .into_stream()
            .map(|c| c.unwrap())
            .collect()
            .await;
        assert_eq!(out[0], Bytes::from_static(b"data: 1\n\ndata: 2\n"));
        assert!(out[1].starts_with(b"\ndata: {\"error\""), "{:?}", out[1]);
        assert!(out[1].ends_with(DONE));
        assert_eq!(out.len(), 2);
    }
}
