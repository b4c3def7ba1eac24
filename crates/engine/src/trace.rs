//! The worker's spans (with `--otlp-traces-endpoint`): a generation's `llm_request` with
//! its `queue`, `prefill` and `decode`, made when it ends from the instants the
//! scheduler thread noted on the sequence ([`SeqTrace`]: no span lives on that thread);
//! the decode side's `kv_pull` and the prefill side's `kv_export` of a KV transfer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use pdserve_kv_transfer::{ReadOutcome, ReadRequest, TransferStats};
use pdserve_telemetry::opentelemetry::trace::SpanContext;
use pdserve_telemetry::propagation::TraceHeaders;
use pdserve_telemetry::semconv as sc;
use pdserve_telemetry::{ChildSpan, Context, KeyValue, Recorded, SpanKind, Timeline};

use crate::sampling::SamplingParams;

/// Instants of one sequence, noted by the scheduler thread (only for traced requests).
#[derive(Debug)]
pub struct SeqTrace {
    submitted: Instant,
    admitted: OnceLock<Instant>,
    first_token: OnceLock<Instant>,
    finished: OnceLock<Instant>,
}

impl SeqTrace {
    /// First admitted to the running batch (the queue wait ends).
    pub fn admitted(&self) {
        let _ = self.admitted.set(Instant::now());
    }

    /// Its first token was sampled (the prefill ends).
    pub fn first_token(&self) {
        let _ = self.first_token.set(Instant::now());
    }

    /// It finished.
    pub fn finished(&self) {
        let _ = self.finished.set(Instant::now());
    }
}

/// A traced generation: its instants and the request span it belongs under.
#[derive(Debug)]
pub struct GenerationTrace {
    seq: Arc<SeqTrace>,
    parent: Context,
    request: Vec<KeyValue>,
}

/// How a traced generation ended.
#[derive(Debug)]
pub struct GenerationEnd<'a> {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens nobody computed for this request.
    pub cached_tokens: usize,
    /// Prompt tokens imported from a peer.
    pub kv_imported_tokens: usize,
    /// OpenAI's `finish_reason`, or the failure.
    pub outcome: Result<&'static str, &'a str>,
}

impl GenerationTrace {
    /// Traces a generation of at most `max_tokens` tokens of `model` under the current
    /// request's span when tracing is on and it is sampled; `None` otherwise. The
    /// request takes [`GenerationTrace::instants`] for the scheduler to note.
    pub fn start(model: &str, max_tokens: usize, s: &SamplingParams) -> Option<Self> {
        let parent = pdserve_telemetry::current().filter(pdserve_telemetry::is_sampled)?;
        let seq = Arc::new(SeqTrace {
            submitted: Instant::now(),
            admitted: OnceLock::new(),
            first_token: OnceLock::new(),
            finished: OnceLock::new(),
        });
        let attributes = vec![
            KeyValue::new(sc::GEN_AI_PROVIDER_NAME, "pdserve"),
            KeyValue::new(sc::GEN_AI_REQUEST_MODEL, model.to_string()),
            KeyValue::new(sc::GEN_AI_RESPONSE_MODEL, model.to_string()),
            KeyValue::new(sc::GEN_AI_REQUEST_MAX_TOKENS, max_tokens as i64),
            KeyValue::new(sc::GEN_AI_REQUEST_TEMPERATURE, f64::from(s.temperature)),
            KeyValue::new(sc::GEN_AI_REQUEST_TOP_P, f64::from(s.top_p)),
        ];
        Some(Self {
            seq,
            parent,
            request: attributes,
        })
    }

    /// Its blocks were published under `id`: the read's `kv_export` links to this request.
    pub fn published(&self, id: &str) {
        use pdserve_telemetry::opentelemetry::trace::TraceContextExt;
        let span = self.parent.span().span_context().clone();
        let mut published = PUBLISHED.lock().unwrap_or_else(|e| e.into_inner());
        published
            .get_or_insert_with(|| {
                lru::LruCache::new(std::num::NonZeroUsize::new(PUBLISHED_CAP).expect("not 0"))
            })
            .put(id.to_string(), span);
    }

    /// Where the scheduler notes the sequence's instants.
    pub fn instants(&self) -> Arc<SeqTrace> {
        self.seq.clone()
    }

    /// Records `llm_request` (vLLM's span name) and its `queue`, `prefill` and `decode`
    /// spans, with a `first_token` event.
    pub fn end(self, end: GenerationEnd<'_>) {
        let timeline = Timeline::now();
        let t = &self.seq;
        let finished = t.finished.get().copied().unwrap_or_else(Instant::now);
        let (admitted, first) = (t.admitted.get().copied(), t.first_token.get().copied());
        let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
        let mut attributes = self.request;
        attributes.extend([
            KeyValue::new(sc::GEN_AI_USAGE_INPUT_TOKENS, end.prompt_tokens as i64),
            KeyValue::new(sc::GEN_AI_USAGE_OUTPUT_TOKENS, end.completion_tokens as i64),
            KeyValue::new(sc::PDSERVE_CACHED_TOKENS, end.cached_tokens as i64),
            KeyValue::new(
                sc::PDSERVE_KV_IMPORTED_TOKENS,
                end.kv_imported_tokens as i64,
            ),
            KeyValue::new(sc::GEN_AI_LATENCY_E2E, secs(t.submitted, finished)),
        ]);
        if let Ok(reason) = end.outcome {
            attributes.push(KeyValue::new(
                sc::GEN_AI_RESPONSE_FINISH_REASONS,
                pdserve_telemetry::opentelemetry::Value::Array(
                    vec![pdserve_telemetry::opentelemetry::StringValue::from(reason)].into(),
                ),
            ));
        }
        if let Some(a) = admitted {
            attributes.push(KeyValue::new(
                sc::GEN_AI_LATENCY_TIME_IN_QUEUE,
                secs(t.submitted, a),
            ));
        }
        if let Some(f) = first {
            let ttft = secs(t.submitted, f);
            attributes.push(KeyValue::new(sc::GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, ttft));
        }
        let mut request = Recorded::new("llm_request", (t.submitted, finished), attributes);
        request.events = first.map(|f| ("first_token", f)).into_iter().collect();
        request.error = end.outcome.err().map(String::from);
        let Some(cx) = timeline.record(&self.parent, request) else {
            return;
        };
        let queue_end = admitted.unwrap_or(finished);
        let wait = secs(t.submitted, queue_end);
        timeline.record(
            &cx,
            Recorded::new(
                "queue",
                (t.submitted, queue_end),
                vec![KeyValue::new(sc::GEN_AI_LATENCY_TIME_IN_QUEUE, wait)],
            ),
        );
        let Some(admitted) = admitted else { return };
        let prefill_end = first.unwrap_or(finished);
        timeline.record(
            &cx,
            Recorded::new(
                "prefill",
                (admitted, prefill_end),
                vec![
                    KeyValue::new(sc::GEN_AI_USAGE_INPUT_TOKENS, end.prompt_tokens as i64),
                    KeyValue::new(sc::PDSERVE_CACHED_TOKENS, end.cached_tokens as i64),
                    KeyValue::new(
                        sc::PDSERVE_KV_IMPORTED_TOKENS,
                        end.kv_imported_tokens as i64,
                    ),
                    KeyValue::new(
                        sc::GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
                        secs(admitted, prefill_end),
                    ),
                ],
            ),
        );
        // A one-token answer (a prefill leg) has nothing after its first token.
        if let Some(first) = first.filter(|_| end.completion_tokens > 1) {
            timeline.record(
                &cx,
                Recorded::new(
                    "decode",
                    (first, finished),
                    vec![
                        KeyValue::new(sc::GEN_AI_USAGE_OUTPUT_TOKENS, end.completion_tokens as i64),
                        KeyValue::new(
                            sc::GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
                            secs(first, finished),
                        ),
                    ],
                ),
            );
        }
    }
}

/// Notes the answer's id (`gen_ai.response.id`) on the request's span, when traced.
pub fn note_response_id(id: &str) {
    if let Some(cx) = pdserve_telemetry::current() {
        use pdserve_telemetry::opentelemetry::trace::TraceContextExt;
        let attribute = KeyValue::new(sc::GEN_AI_RESPONSE_ID, id.to_string());
        cx.span().set_attribute(attribute);
    }
}

/// The orchestrator's `prefill leg` span to the prefill worker at `url` and the trace
/// context the leg carries (the request's own when it is not sampled); both `None`
/// when the request is not traced.
pub fn prefill_leg(url: &str) -> (Option<ChildSpan>, Option<TraceHeaders>) {
    let Some(cx) = pdserve_telemetry::current() else {
        return (None, None);
    };
    let span = pdserve_telemetry::is_sampled(&cx)
        .then(|| {
            let attributes = vec![
                KeyValue::new(sc::PDSERVE_LEG, "prefill"),
                KeyValue::new(sc::URL_FULL, format!("{url}/v1/completions")),
            ];
            ChildSpan::start(&cx, "prefill leg", SpanKind::Client, attributes)
        })
        .flatten();
    let headers = match &span {
        Some(span) => span.headers(),
        None => TraceHeaders::of(&cx),
    };
    (span, headers)
}

/// The decode side's `kv_pull` span (a client span under the current request), whose
/// trace context the read request carries to the peer; `None` when tracing is off.
pub fn pull_span(read: &mut ReadRequest, addr: &str) -> Option<ChildSpan> {
    let cx = pdserve_telemetry::current()?;
    let span = ChildSpan::start(
        &cx,
        "kv_pull",
        SpanKind::Client,
        vec![
            KeyValue::new(sc::SERVER_ADDRESS, addr.to_string()),
            KeyValue::new(sc::PDSERVE_KV_REQUEST_ID, read.request_id.clone()),
        ],
    )?;
    if let Some(headers) = span.headers() {
        read.traceparent = Some(headers.traceparent);
        read.tracestate = headers.tracestate;
    }
    Some(span)
}

/// Reads being served whose reader sent a trace context: where and when each began, and
/// the span of the request that published the blocks.
type Export = (Context, Instant, Option<SpanContext>);
static EXPORTS: Mutex<Option<HashMap<String, Export>>> = Mutex::new(None);

/// The span of the traced request that published each recent publication (by its
/// `remote_request_id`), for its `kv_export`'s link; bounded, oldest first out.
static PUBLISHED: Mutex<Option<lru::LruCache<String, SpanContext>>> = Mutex::new(None);

/// Most publications remembered for their links.
const PUBLISHED_CAP: usize = 4096;

/// The prefill side accepted a read that began at `began`: its `kv_export` span is
/// recorded when the read ends ([`export_finished`]), under the reader's `kv_pull`.
pub fn export_accepted(request: &ReadRequest, began: Instant) {
    if !pdserve_telemetry::enabled() || request.traceparent.is_none() {
        return;
    }
    let parent = TraceHeaders::context(
        request.traceparent.as_deref(),
        request.tracestate.as_deref(),
    );
    let publisher = PUBLISHED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|p| p.pop(&request.request_id));
    let mut exports = EXPORTS.lock().unwrap_or_else(|e| e.into_inner());
    exports
        .get_or_insert_with(HashMap::new)
        .insert(request.request_id.clone(), (parent, began, publisher));
}

/// A read of `request_id` ended: its `kv_export` span, if it was traced.
pub fn export_finished(request_id: &str, outcome: &ReadOutcome, stats: &TransferStats) {
    if !pdserve_telemetry::enabled() {
        return;
    }
    let Some((parent, began, publisher)) = EXPORTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| m.remove(request_id))
    else {
        return;
    };
    let mut span = Recorded::new(
        "kv_export",
        (began, Instant::now()),
        vec![
            KeyValue::new(sc::PDSERVE_KV_REQUEST_ID, request_id.to_string()),
            KeyValue::new(sc::PDSERVE_KV_BLOCKS, stats.blocks as i64),
            KeyValue::new(sc::PDSERVE_KV_BYTES, stats.bytes as i64),
            KeyValue::new(sc::PDSERVE_KV_SECONDS, stats.elapsed.as_secs_f64()),
        ],
    );
    span.kind = SpanKind::Server;
    span.links = publisher.into_iter().collect();
    if let ReadOutcome::Failed(why) = outcome {
        span.error = Some(why.clone());
    }
    Timeline::now().record(&parent, span);
}

/// Records a read refused before it began (no [`export_finished`] follows).
pub fn export_refused(request: &ReadRequest, began: Instant, why: &str) {
    if !pdserve_telemetry::enabled() || request.traceparent.is_none() {
        return;
    }
    let parent = TraceHeaders::context(
        request.traceparent.as_deref(),
        request.tracestate.as_deref(),
    );
    let mut span = Recorded::new(
        "kv_export",
        (began, Instant::now()),
        vec![KeyValue::new(
            sc::PDSERVE_KV_REQUEST_ID,
            request.request_id.clone(),
        )],
    );
    span.kind = SpanKind::Server;
    span.error = Some(why.to_string());
    Timeline::now().record(&parent, span);
}
