//! Trace export for `pdserve gateway` and `pdserve worker`: on only with
//! `--otlp-traces-endpoint` or the `OTEL_EXPORTER_OTLP_*ENDPOINT` variables.

use anyhow::Context;
use pdserve_telemetry::{KeyValue, Telemetry, TraceConfig, TracingArgs};

/// Starts exporting traces as `service` when `args` or the environment ask for it;
/// `role` is the worker's, recorded on every span's resource.
pub fn start(args: &TracingArgs, service: &str, role: Option<&str>) -> anyhow::Result<Telemetry> {
    let config = TraceConfig::resolve(args, service, |name| std::env::var(name).ok());
    let attributes = role
        .map(|r| {
            vec![KeyValue::new(
                pdserve_telemetry::semconv::PDSERVE_ROLE,
                r.to_string(),
            )]
        })
        .unwrap_or_default();
    Telemetry::init(config.as_ref(), attributes).context("cannot set up trace export")
}
