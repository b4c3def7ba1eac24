//! The gateway's spans (with `--otlp-traces-endpoint`): the request's attributes on its
//! server span, one `routing` span per worker choice, and a client span per leg whose
//! W3C trace context the leg carries, so each worker's spans sit under the leg that
//! reached it. Without tracing every function here returns at its first line.

use std::borrow::Cow;
use std::time::Instant;

use http::HeaderValue;
use pdserve_protocol::WorkerRole;
use pdserve_telemetry::opentelemetry::trace::TraceContextExt;
use pdserve_telemetry::semconv as sc;
use pdserve_telemetry::{ChildSpan, Context, KeyValue, Recorded, SpanKind, Timeline};
use serde_json::Value;

use crate::clients::worker_client::{ForwardHeaders, LegError};
use crate::fleet::registry::Worker;
use crate::ingress::request::ClientRequest;
use crate::policy::Choice;

/// The request's trace context and the headers its legs carry without a span of their
/// own: the request's server span, when tracing is on and the request has one.
pub fn request_context(headers: &mut ForwardHeaders) -> Option<Context> {
    let cx = pdserve_telemetry::current()?;
    set_headers(headers, &cx);
    Some(cx)
}

fn set_headers(headers: &mut ForwardHeaders, cx: &Context) {
    let Some(w3c) = pdserve_telemetry::propagation::TraceHeaders::of(cx) else {
        return;
    };
    headers.traceparent = HeaderValue::from_str(&w3c.traceparent).ok();
    headers.tracestate = w3c
        .tracestate
        .as_deref()
        .and_then(|s| HeaderValue::from_str(s).ok());
}

/// Notes the GenAI attributes of `request` (model, limits) on the request's span (the
/// operation is the route's, noted with the span).
pub fn describe(cx: Option<&Context>, request: &ClientRequest) {
    let Some(cx) = cx.filter(|cx| pdserve_telemetry::is_sampled(cx)) else {
        return;
    };
    let (model, generation, extra) = match request {
        ClientRequest::Chat(r) => (&r.model, &r.generation, &r.extra),
        ClientRequest::Completion(r) => (&r.model, &r.generation, &r.extra),
    };
    let number = |name: &str| {
        request
            .verbatim_number(name)
            .and_then(|text| text.parse::<f64>().ok())
            .or_else(|| extra.get(name).and_then(Value::as_f64))
    };
    let span = cx.span();
    span.set_attribute(KeyValue::new(sc::GEN_AI_PROVIDER_NAME, "pdserve"));
    if let Some(model) = model {
        span.set_attribute(KeyValue::new(sc::GEN_AI_REQUEST_MODEL, model.clone()));
    }
    if let Some(max) = generation.max_completion_tokens.or(generation.max_tokens) {
        span.set_attribute(KeyValue::new(sc::GEN_AI_REQUEST_MAX_TOKENS, max));
    }
    if let Some(t) = number("temperature") {
        span.set_attribute(KeyValue::new(sc::GEN_AI_REQUEST_TEMPERATURE, t));
    }
    if let Some(p) = number("top_p") {
        span.set_attribute(KeyValue::new(sc::GEN_AI_REQUEST_TOP_P, p));
    }
    if let Some(n) = generation.n {
        span.set_attribute(KeyValue::new(sc::GEN_AI_REQUEST_N, n));
    }
}

/// Records the `routing` span of one choice: the policy, the role, the chosen worker
/// among `candidates`, and what it held of the prompt when the policy knew.
pub fn routing(
    cx: &Context,
    began: Instant,
    policy: &str,
    role: WorkerRole,
    choice: &Choice,
    candidates: usize,
) {
    if !pdserve_telemetry::is_sampled(cx) {
        return;
    }
    let mut attributes = vec![
        KeyValue::new(sc::PDSERVE_ROUTING_POLICY, policy.to_string()),
        KeyValue::new(sc::PDSERVE_ROUTING_ROLE, role.as_str()),
        KeyValue::new(sc::PDSERVE_ROUTING_WORKER, choice.worker.base.clone()),
        KeyValue::new(sc::PDSERVE_ROUTING_CANDIDATES, candidates as i64),
    ];
    if let Some(forecast) = choice.forecast {
        if let Some(ttft) = forecast.ttft {
            attributes.push(KeyValue::new(sc::PDSERVE_ROUTING_PREDICTED_TTFT_MS, ttft));
        }
        if let Some(tpot) = forecast.tpot {
            attributes.push(KeyValue::new(sc::PDSERVE_ROUTING_PREDICTED_TPOT_MS, tpot));
        }
    }
    if let Some(cache) = choice.cache {
        let source = match cache.source {
            crate::policy::MatchSource::Events => "events",
            crate::policy::MatchSource::Approximate => "approximate",
        };
        attributes.extend([
            KeyValue::new(sc::PDSERVE_ROUTING_CACHE_SOURCE, source),
            KeyValue::new(sc::PDSERVE_ROUTING_CACHE_MATCHED, cache.matched as i64),
            KeyValue::new(sc::PDSERVE_ROUTING_CACHE_PROMPT, cache.prompt_len as i64),
        ]);
    }
    let span = Recorded::new("routing", (began, Instant::now()), attributes);
    Timeline::now().record(cx, span);
}

/// A leg's client span (`prefill leg`, `decode leg`, …) to `worker` under the request's
/// span; `None` when the request is not traced.
pub fn leg(
    cx: Option<&Context>,
    leg: &'static str,
    worker: &Worker,
    url: &str,
) -> Option<ChildSpan> {
    // Unsampled: no span; the leg carries the request's (unsampled) context as it is.
    let cx = cx.filter(|cx| pdserve_telemetry::is_sampled(cx))?;
    let (host, port) = host_port(&worker.base);
    let mut attributes = vec![
        KeyValue::new(sc::PDSERVE_LEG, leg),
        KeyValue::new(sc::HTTP_REQUEST_METHOD, "POST"),
        KeyValue::new(sc::URL_FULL, url.to_string()),
        KeyValue::new(sc::SERVER_ADDRESS, host),
    ];
    if let Some(port) = port {
        attributes.push(KeyValue::new(sc::SERVER_PORT, port));
    }
    let name = match leg {
        "prefill" => "prefill leg",
        "decode" => "decode leg",
        "prefill_decode" => "prefill_decode leg",
        "encode" => "encode leg",
        _ => "leg",
    };
    ChildSpan::start(cx, name, SpanKind::Client, attributes)
}

/// The headers a leg under `span` carries: `headers` naming the leg's span as the
/// parent (unchanged, without a copy, when there is no span).
pub fn leg_headers<'a>(
    headers: &'a ForwardHeaders,
    span: Option<&ChildSpan>,
) -> Cow<'a, ForwardHeaders> {
    match span {
        None => Cow::Borrowed(headers),
        Some(span) => {
            let mut headers = headers.clone();
            set_headers(&mut headers, span.context());
            Cow::Owned(headers)
        }
    }
}

/// A leg's answer began streaming (its span ends with the relay).
pub fn leg_streaming(span: Option<&ChildSpan>) {
    if let Some(span) = span {
        span.set(KeyValue::new(sc::HTTP_RESPONSE_STATUS_CODE, 200_i64));
    }
}

/// Ends a leg's span with its outcome.
pub fn leg_done<T>(span: Option<ChildSpan>, result: &Result<T, LegError>) {
    let Some(span) = span else { return };
    match result {
        Ok(_) => span.set(KeyValue::new(sc::HTTP_RESPONSE_STATUS_CODE, 200_i64)),
        Err(e) => {
            if let Some(status) = e.status {
                span.set(KeyValue::new(
                    sc::HTTP_RESPONSE_STATUS_CODE,
                    i64::from(status.as_u16()),
                ));
            }
            span.set(KeyValue::new(
                sc::ERROR_TYPE,
                crate::clients::worker_client::fault_label(e.kind),
            ));
            span.fail(e.failure_message());
        }
    }
    span.end();
}

/// `http://host:port/…` → (`host`, port).
fn host_port(base: &str) -> (String, Option<i64>) {
    let rest = base.split_once("://").map_or(base, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => {
            (host.to_string(), port.parse().ok())
        }
        _ => (authority.to_string(), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_port_of_a_worker_url() {
        assert_eq!(
            host_port("http://10.0.0.5:8100"),
            ("10.0.0.5".into(), Some(8100))
        );
        assert_eq!(host_port("http://[::1]:9/v1"), ("[::1]".into(), Some(9)));
        assert_eq!(
            host_port("https://workers.svc/p"),
            ("workers.svc".into(), None)
        );
    }

    #[test]
    fn untraced_legs_cost_nothing() {
        let headers = ForwardHeaders::from_client(&http::HeaderMap::new());
        let mut traced = headers.clone();
        assert!(
            request_context(&mut traced).is_none(),
            "tracing is off in tests"
        );
        assert!(traced.traceparent.is_none());
        assert!(matches!(leg_headers(&headers, None), Cow::Borrowed(_)));
    }
}
