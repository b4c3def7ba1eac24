//! `--otlp-traces-endpoint` and the standard `OTEL_*` variables, resolved into whether
//! and where traces go.

/// The tracing flag shared by `pdserve gateway` and `pdserve worker`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TracingArgs {
    /// Export OpenTelemetry traces over OTLP/HTTP (protobuf) to this URL, e.g.
    /// `http://collector:4318/v1/traces` (`/v1/traces` is added to a URL without a path).
    /// Unset: traces go where `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` say, and without those tracing is off (and costs
    /// nothing). `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`,
    /// `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_BSP_*` are honoured.
    #[arg(long, env = "PDSERVE_OTLP_TRACES_ENDPOINT")]
    pub otlp_traces_endpoint: Option<String>,
}

/// Where traces go, when they go anywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    /// The traces URL given on the command line; `None`: the `OTEL_EXPORTER_OTLP_*`
    /// variables name it (the exporter reads them).
    pub endpoint: Option<String>,
    /// `service.name` unless `OTEL_SERVICE_NAME` is set.
    pub service_name: String,
}

impl TraceConfig {
    /// Whether and where to export, from `args` and the environment `env` (a lookup, so
    /// tests need not touch the process's variables); `None`: tracing is off.
    pub fn resolve(
        args: &TracingArgs,
        service_name: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Option<Self> {
        let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return None;
        }
        let endpoint = match args.otlp_traces_endpoint.as_deref().map(str::trim) {
            Some(url) if !url.is_empty() => Some(traces_url(url)),
            _ if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
                || set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() =>
            {
                None
            }
            _ => return None,
        };
        Some(Self {
            endpoint,
            service_name: service_name.to_string(),
        })
    }
}

/// `url` with OTLP/HTTP's `/v1/traces` path when it has none (vLLM's flag is often given
/// as the collector's base URL).
fn traces_url(url: &str) -> String {
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    match after_scheme.find('/') {
        Some(i) if !after_scheme[i..].trim_end_matches('/').is_empty() => url.to_string(),
        _ => format!("{}/v1/traces", url.trim_end_matches('/')),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: Option<&str>) -> TracingArgs {
        TracingArgs {
            otlp_traces_endpoint: url.map(String::from),
        }
    }

    #[test]
    fn off_without_a_flag_or_an_otel_endpoint() {
        assert_eq!(TraceConfig::resolve(&args(None), "svc", |_| None), None);
        assert_eq!(
            TraceConfig::resolve(&args(Some(" ")), "svc", |_| None),
            None
        );
        let unrelated = |k: &str| (k == "OTEL_SERVICE_NAME").then(|| "x".to_string());
        assert_eq!(TraceConfig::resolve(&args(None), "svc", unrelated), None);
    }

    #[test]
    fn the_flag_wins_and_gets_the_traces_path() {
        let env = |k: &str| (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://o:1".into());
        let c = TraceConfig::resolve(&args(Some("http://c:4318")), "svc", env).unwrap();
        assert_eq!(c.endpoint.as_deref(), Some("http://c:4318/v1/traces"));
        let c = TraceConfig::resolve(&args(Some("http://c:4318/x/v1/traces")), "s", |_| None);
        assert_eq!(
            c.unwrap().endpoint.as_deref(),
            Some("http://c:4318/x/v1/traces")
        );
    }

    #[test]
    fn otel_variables_turn_it_on_and_sdk_disabled_off() {
        let env = |k: &str| (k == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").then(|| "http://t".into());
        let c = TraceConfig::resolve(&args(None), "svc", env).unwrap();
        assert_eq!(c.endpoint, None);
        let off = |k: &str| (k == "OTEL_SDK_DISABLED").then(|| "true".into());
        assert_eq!(
            TraceConfig::resolve(&args(Some("http://c")), "svc", off),
            None
        );
    }
}
