//! OpenTelemetry traces for pdserve's gateway and workers.
//!
//! Off unless `--otlp-traces-endpoint` (or an `OTEL_EXPORTER_OTLP_*ENDPOINT` variable) is
//! given. When off nothing is installed: [`tracer`] is `None` (one atomic load), no
//! middleware wraps the routes and no span is built, so a request costs what it did
//! before. When on, spans go to an OTLP/HTTP (protobuf) collector from a batch processor
//! on the tokio runtime, and W3C `traceparent`/`tracestate` carry the trace across
//! processes ([`propagation`]).

pub mod config;
pub mod exporter;
pub mod http;
pub mod propagation;
pub mod semconv;
pub mod spans;

use std::sync::OnceLock;

pub use config::{TraceConfig, TracingArgs};
pub use exporter::{Telemetry, TelemetryError};
pub use opentelemetry;
pub use opentelemetry::trace::SpanKind;
pub use opentelemetry::{Context, KeyValue};
pub use spans::{ChildSpan, Recorded, Timeline};

/// The process's tracer, set once by [`Telemetry::init`] when tracing is on.
static TRACER: OnceLock<opentelemetry_sdk::trace::SdkTracer> = OnceLock::new();

/// The tracer when tracing is on; `None` (the whole cost of tracing when off) otherwise.
#[inline]
pub fn tracer() -> Option<&'static opentelemetry_sdk::trace::SdkTracer> {
    TRACER.get()
}

/// Whether this process exports traces.
#[inline]
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The context of the request being served (its server span), when tracing is on and
/// the current task runs inside one (see [`http::trace_requests`]).
pub fn current() -> Option<Context> {
    use opentelemetry::trace::TraceContextExt;
    tracer()?;
    let cx = Context::current();
    cx.has_active_span().then_some(cx)
}

/// Whether `cx`'s span is sampled: under an unsampled one (`OTEL_TRACES_SAMPLER` drew
/// no, or the client's `traceparent` said so) no span is built, only the context passed on.
pub fn is_sampled(cx: &Context) -> bool {
    use opentelemetry::trace::TraceContextExt;
    cx.span().span_context().is_sampled()
}

/// `future`, run with the current request's context as its current context when
/// tracing is on (for a future spawned onto another task); as it is otherwise.
pub fn in_current_context<F: std::future::Future>(
    future: F,
) -> futures::future::Either<F, opentelemetry::context::WithContext<F>> {
    use opentelemetry::context::FutureExt;
    match current() {
        Some(cx) => futures::future::Either::Right(future.with_context(cx)),
        None => futures::future::Either::Left(future),
    }
}
