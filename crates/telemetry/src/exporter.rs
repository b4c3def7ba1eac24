//! The OTLP/HTTP exporter and the tracer provider: built only when tracing is on, flushed
//! and shut down on exit.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

use crate::config::TraceConfig;

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (a bad endpoint URL, say).
    #[error("cannot build the OTLP trace exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// The HTTP client for the exporter could not be built.
    #[error("cannot build the OTLP HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// Tracing was already set up in this process.
    #[error("tracing is already set up in this process")]
    AlreadyInitialised,
}

/// The process's trace pipeline; [`Telemetry::shutdown`] flushes it. Without tracing it
/// holds nothing.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// How long the final flush may take at exit.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(5);

impl Telemetry {
    /// Sets up export as `config` says (must run inside a tokio runtime); `None` is
    /// tracing off: no exporter is built and [`crate::tracer`] stays `None`.
    /// `attributes` are added to the resource (the worker's role, say).
    pub fn init(
        config: Option<&TraceConfig>,
        attributes: Vec<KeyValue>,
    ) -> Result<Self, TelemetryError> {
        let Some(config) = config else {
            return Ok(Self::default());
        };
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()?;
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client);
        if let Some(url) = &config.endpoint {
            exporter = exporter.with_endpoint(url.clone());
        }
        let exporter = exporter.build()?;
        // The batch processor's task runs on tokio, where the async reqwest client works.
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(config.service_name.clone());
        }
        let resource = resource
            .with_attribute(KeyValue::new(
                "service.instance.id",
                format!("{}-{}", config.service_name, std::process::id()),
            ))
            .with_attributes(attributes)
            .build();
        // The sampler comes from OTEL_TRACES_SAMPLER / _ARG (the SDK reads them), by
        // default parent-based always-on: a client's unsampled traceparent is honoured.
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("pdserve");
        crate::TRACER
            .set(tracer)
            .map_err(|_| TelemetryError::AlreadyInitialised)?;
        tracing::info!(
            endpoint = config.endpoint.as_deref().unwrap_or("from OTEL_EXPORTER_OTLP_*"),
            service = %config.service_name,
            "exporting OpenTelemetry traces over OTLP/HTTP"
        );
        Ok(Self {
            provider: Some(provider),
        })
    }

    /// Whether an exporter was built.
    pub fn is_exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still queued and stops the exporter (bounded in time).
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The SDK waits for its batch task synchronously: off the async workers.
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_LIMIT))
                .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("flushing the trace exporter failed: {e}"),
            Err(e) => tracing::warn!("flushing the trace exporter failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_a_config_no_exporter_is_built() {
        let telemetry = Telemetry::init(None, Vec::new()).unwrap();
        assert!(!telemetry.is_exporting());
        assert!(crate::tracer().is_none());
        assert!(crate::current().is_none());
        telemetry.shutdown().await;
    }
}
