//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers and the KV
//! transfer's read request.

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The W3C header naming the caller's span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header with vendor trace state.
pub const TRACESTATE: &str = "tracestate";

/// A span's trace context as the W3C headers write it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TraceHeaders {
    /// `traceparent`.
    pub traceparent: String,
    /// `tracestate`, when there is any.
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// The headers naming `cx`'s span; `None` when `cx` has no valid span.
    pub fn of(cx: &Context) -> Option<Self> {
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut pairs = Pairs::default();
        TraceContextPropagator::new().inject_context(cx, &mut pairs);
        Some(Self {
            traceparent: pairs.traceparent?,
            tracestate: pairs.tracestate.filter(|s| !s.is_empty()),
        })
    }

    /// The remote parent these headers name, as a context (empty when they are invalid).
    pub fn context(traceparent: Option<&str>, tracestate: Option<&str>) -> Context {
        let pairs = Pairs {
            traceparent: traceparent.map(String::from),
            tracestate: tracestate.map(String::from),
        };
        TraceContextPropagator::new().extract(&pairs)
    }

    /// Writes both headers into `headers`.
    pub fn insert_into(&self, headers: &mut HeaderMap) {
        for (name, value) in self.header_values() {
            headers.insert(name, value);
        }
    }

    /// The headers as `(name, value)` pairs, skipping a value that is not a valid header.
    pub fn header_values(&self) -> Vec<(HeaderName, HeaderValue)> {
        let mut out = Vec::with_capacity(2);
        if let Ok(v) = HeaderValue::from_str(&self.traceparent) {
            out.push((HeaderName::from_static(TRACEPARENT), v));
        }
        if let Some(v) = self
            .tracestate
            .as_deref()
            .and_then(|s| HeaderValue::from_str(s).ok())
        {
            out.push((HeaderName::from_static(TRACESTATE), v));
        }
        out
    }
}

/// The remote parent a request's headers name (an empty context when they name none).
pub fn extract(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

#[derive(Default)]
struct Pairs {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Injector for Pairs {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = Some(value),
            TRACESTATE => self.tracestate = Some(value),
            _ => {}
        }
    }
}

impl Extractor for Pairs {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent.as_deref(),
            TRACESTATE => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, HeaderValue::from_static(tp));
        headers.insert(TRACESTATE, HeaderValue::from_static("k=v"));
        let cx = extract(&headers);
        let span = cx.span();
        assert!(span.span_context().is_remote());
        assert_eq!(
            span.span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let out = TraceHeaders::of(&cx).unwrap();
        assert_eq!(out.traceparent, tp);
        assert_eq!(out.tracestate.as_deref(), Some("k=v"));
        let again = TraceHeaders::context(Some(tp), None);
        assert_eq!(
            again.span().span_context().span_id(),
            cx.span().span_context().span_id()
        );
    }

    #[test]
    fn garbage_is_no_parent() {
        let cx = TraceHeaders::context(Some("00-zz-00"), None);
        assert!(!cx.span().span_context().is_valid());
        assert_eq!(TraceHeaders::of(&cx), None);
    }
}
