//! Building spans: a child span open while something runs ([`ChildSpan`]), and spans
//! recorded afterwards from timestamps taken elsewhere ([`Timeline`]: the scheduler
//! thread notes instants; spans are made from them when the request ends).

use std::borrow::Cow;
use std::time::{Instant, SystemTime};

use opentelemetry::trace::{Link, SpanContext, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};

use crate::propagation::TraceHeaders;

/// A span started under a parent; it ends when dropped (or at [`ChildSpan::end`]).
#[derive(Debug, Clone)]
pub struct ChildSpan {
    cx: Context,
    /// Keeps the parent's span open at least as long as this one.
    _parent: Context,
}

impl ChildSpan {
    /// Starts `name` under `parent`; `None` when tracing is off or `parent` is not
    /// sampled (its context is then what travels on).
    pub fn start(
        parent: &Context,
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
    ) -> Option<Self> {
        let tracer = crate::tracer()?;
        if !crate::is_sampled(parent) {
            return None;
        }
        let span = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(tracer, parent);
        Some(Self {
            cx: parent.with_span(span),
            _parent: parent.clone(),
        })
    }

    /// The span's context (a parent for spans under it).
    pub fn context(&self) -> &Context {
        &self.cx
    }

    /// The W3C headers naming this span, for the request it makes.
    pub fn headers(&self) -> Option<TraceHeaders> {
        TraceHeaders::of(&self.cx)
    }

    /// Adds an attribute.
    pub fn set(&self, attribute: KeyValue) {
        self.cx.span().set_attribute(attribute);
    }

    /// Marks the span failed with `why`.
    pub fn fail(&self, why: impl Into<Cow<'static, str>>) {
        self.cx.span().set_status(Status::error(why));
    }

    /// Ends the span now (it would end when the last clone drops anyway).
    pub fn end(self) {
        self.cx.span().end();
    }
}

/// Converts instants to wall-clock times for spans recorded after the fact.
#[derive(Debug, Clone, Copy)]
pub struct Timeline {
    instant: Instant,
    wall: SystemTime,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::now()
    }
}

impl Timeline {
    /// Anchored now.
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    /// The wall-clock time of `at`.
    pub fn wall(&self, at: Instant) -> SystemTime {
        match self.instant.checked_duration_since(at) {
            Some(ago) => self.wall - ago,
            None => self.wall + (at - self.instant),
        }
    }

    /// Records a finished span `name` under `parent` from `start` to `end`, with
    /// `events` at their instants and `error` as its failure; returns its context for
    /// spans under it (`None` when tracing is off or `parent` is not sampled).
    pub fn record(&self, parent: &Context, span: Recorded) -> Option<Context> {
        let tracer = crate::tracer()?;
        if !crate::is_sampled(parent) {
            return None;
        }
        let (start, end) = span.during;
        let built = tracer
            .span_builder(span.name)
            .with_kind(span.kind)
            .with_start_time(self.wall(start))
            .with_attributes(span.attributes)
            .with_links(span.links.into_iter().map(Link::with_context).collect())
            .start_with_context(tracer, parent);
        let cx = parent.with_span(built);
        let live = cx.span();
        for (name, at) in span.events {
            live.add_event_with_timestamp(name, self.wall(at), Vec::new());
        }
        if let Some(why) = span.error {
            live.set_status(Status::error(why));
        }
        live.end_with_timestamp(self.wall(end.max(start)));
        Some(cx)
    }
}

/// A span recorded after the fact (see [`Timeline::record`]).
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Its name.
    pub name: Cow<'static, str>,
    /// Its kind.
    pub kind: SpanKind,
    /// From, to.
    pub during: (Instant, Instant),
    /// Its attributes.
    pub attributes: Vec<KeyValue>,
    /// Named instants within it.
    pub events: Vec<(&'static str, Instant)>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Spans of other requests (or traces) it relates to.
    pub links: Vec<SpanContext>,
}

impl Recorded {
    /// An internal span `name` from `start` to `end` with `attributes`.
    pub fn new(
        name: impl Into<Cow<'static, str>>,
        during: (Instant, Instant),
        attributes: Vec<KeyValue>,
    ) -> Self {
        Self {
            name: name.into(),
            kind: SpanKind::Internal,
            during,
            attributes,
            events: Vec::new(),
            error: None,
            links: Vec::new(),
        }
    }
}

/// Seconds of `d`, as the latency attributes want them.
pub fn seconds(d: std::time::Duration) -> f64 {
    d.as_secs_f64()
}
