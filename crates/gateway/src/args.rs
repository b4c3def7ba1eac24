//! `pdserve gateway` flags and the runtime configuration they resolve to.

use std::num::NonZeroUsize;
use std::time::Duration;

use reqwest::Url;

use crate::GatewayError;

/// `pdserve gateway` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on.
    #[arg(long, env = "PDSERVE_GATEWAY_HOST", default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on.
    #[arg(long, env = "PDSERVE_GATEWAY_PORT", default_value_t = 8000)]
    pub port: u16,

    /// Prefill worker base URL (e.g. http://10.0.0.1:8100); repeat for a pool.
    /// Comma-separated in the environment variable.
    #[arg(long = "prefill", env = "PDSERVE_PREFILL", value_delimiter = ',')]
    pub prefill: Vec<String>,

    /// Decode worker base URL; repeat for a pool. Comma-separated in the environment variable.
    #[arg(long = "decode", env = "PDSERVE_DECODE", value_delimiter = ',')]
    pub decode: Vec<String>,

    /// Aggregated (prefill+decode) worker base URL, used when no prefill/decode pair is
    /// configured; repeat for a pool. Comma-separated in the environment variable.
    #[arg(long = "worker", env = "PDSERVE_WORKER", value_delimiter = ',')]
    pub worker: Vec<String>,

    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, env = "PDSERVE_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// How many times a decode leg that fails (5xx or transport error) before its first
    /// byte is retried on another decode worker. 0 disables retries.
    #[arg(long, env = "PDSERVE_DECODE_RETRIES", default_value_t = 1)]
    pub decode_retries: u32,

    /// Time limit in seconds for the whole prefill leg; past it the client gets 504.
    #[arg(long, env = "PDSERVE_PREFILL_TIMEOUT_SECS", default_value = "300", value_parser = parse_secs)]
    pub prefill_timeout_secs: Duration,

    /// Time limit in seconds for the decode (or aggregated) leg's first byte; past it the
    /// client gets 504. A non-stream answer's first byte comes when it is complete, so for
    /// non-stream requests this bounds the whole generation.
    #[arg(long, env = "PDSERVE_DECODE_TIMEOUT_SECS", default_value = "300", value_parser = parse_secs)]
    pub decode_timeout_secs: Duration,

    /// Longest silence in seconds between two chunks of a streaming response; past it the
    /// stream ends with an error event.
    #[arg(long, env = "PDSERVE_STREAM_IDLE_TIMEOUT_SECS", default_value = "120", value_parser = parse_secs)]
    pub stream_idle_timeout_secs: Duration,

    /// How long in seconds a conversation's decode KV handle is kept for its next turn.
    /// Keep it below the workers' KV abort timeout (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
    #[arg(long, env = "PDSERVE_CONVERSATION_TTL_SECS", default_value = "450", value_parser = parse_secs)]
    pub conversation_ttl_secs: Duration,

    /// Most conversations whose KV handle is kept; the least recently used is dropped first.
    #[arg(long, env = "PDSERVE_MAX_CONVERSATIONS", default_value = "100000")]
    pub max_conversations: NonZeroUsize,

    /// Seconds an idle pooled upstream connection is kept. Must stay below the workers'
    /// keep-alive (vLLM closes idle connections after 5 s) or requests race the close.
    #[arg(long, env = "PDSERVE_UPSTREAM_IDLE_TIMEOUT_SECS", default_value = "2.5", value_parser = parse_secs)]
    pub upstream_idle_timeout_secs: Duration,

    /// Time limit in seconds for opening a TCP connection to a worker.
    #[arg(long, env = "PDSERVE_CONNECT_TIMEOUT_SECS", default_value = "5", value_parser = parse_secs)]
    pub connect_timeout_secs: Duration,
}

/// Parses a non-negative number of seconds (fractions allowed) into a `Duration`.
fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// Everything a running gateway needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Prefill worker base URLs.
    pub prefill: Vec<Url>,
    /// Decode worker base URLs.
    pub decode: Vec<Url>,
    /// Aggregated worker base URLs.
    pub worker: Vec<Url>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Decode retries on another worker before the first byte.
    pub decode_retries: u32,
    /// Limit for the whole prefill leg.
    pub prefill_timeout: Duration,
    /// Limit for the decode leg's first byte.
    pub decode_timeout: Duration,
    /// Longest gap between stream chunks.
    pub stream_idle_timeout: Duration,
    /// Lifetime of a cached conversation KV handle.
    pub conversation_ttl: Duration,
    /// Capacity of the conversation cache.
    pub max_conversations: NonZeroUsize,
    /// Lifetime of an idle pooled upstream connection.
    pub upstream_idle_timeout: Duration,
    /// Limit for opening an upstream connection.
    pub connect_timeout: Duration,
}

impl GatewayConfig {
    /// A configuration with the flag defaults and the given pools.
    pub fn new(prefill: Vec<Url>, decode: Vec<Url>, worker: Vec<Url>) -> Self {
        Self {
            prefill,
            decode,
            worker,
            max_body_bytes: 32 * 1024 * 1024,
            decode_retries: 1,
            prefill_timeout: Duration::from_secs(300),
            decode_timeout: Duration::from_secs(300),
            stream_idle_timeout: Duration::from_secs(120),
            conversation_ttl: Duration::from_secs(450),
            max_conversations: NonZeroUsize::new(100_000).expect("non-zero"),
            upstream_idle_timeout: Duration::from_millis(2500),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl GatewayArgs {
    /// The `host:port` to bind (`host` may be a name such as `localhost`).
    pub fn listen_addr(&self) -> String {
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        if host.contains(':') {
            format!("[{host}]:{}", self.port)
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// Validates the flags into a runtime configuration.
    pub fn to_config(&self) -> Result<GatewayConfig, GatewayError> {
        let urls = |flag: &str, raw: &[String]| -> Result<Vec<Url>, GatewayError> {
            raw.iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_worker_url(flag, s))
                .collect()
        };
        let prefill = urls("--prefill", &self.prefill)?;
        let decode = urls("--decode", &self.decode)?;
        let worker = urls("--worker", &self.worker)?;
        if prefill.is_empty() != decode.is_empty() && worker.is_empty() {
            return Err(GatewayError::Config(
                "prefill/decode disaggregation needs at least one --prefill and one --decode worker \
                 (or give --worker for aggregated serving)"
                    .into(),
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(GatewayError::Config(
                "--max-body-bytes must be positive".into(),
            ));
        }
        Ok(GatewayConfig {
            prefill,
            decode,
            worker,
            max_body_bytes: self.max_body_bytes,
            decode_retries: self.decode_retries,
            prefill_timeout: self.prefill_timeout_secs,
            decode_timeout: self.decode_timeout_secs,
            stream_idle_timeout: self.stream_idle_timeout_secs,
            conversation_ttl: self.conversation_ttl_secs,
            max_conversations: self.max_conversations,
            upstream_idle_timeout: self.upstream_idle_timeout_secs,
            connect_timeout: self.connect_timeout_secs,
        })
    }
}

/// Parses a worker base URL (`http://host:port`, optional path prefix, no trailing `/v1`).
pub fn parse_worker_url(flag: &str, raw: &str) -> Result<Url, GatewayError> {
    let trimmed = raw.trim().trim_end_matches('/');
    let url = Url::parse(trimmed)
        .map_err(|e| GatewayError::Config(format!("{flag} `{raw}` is not a URL: {e}")))?;
    if url.scheme() != "http" {
        return Err(GatewayError::Config(format!(
            "{flag} `{raw}`: only http:// workers are supported"
        )));
    }
    if url.host_str().is_none() {
        return Err(GatewayError::Config(format!("{flag} `{raw}` has no host")));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GatewayArgs,
    }

    #[test]
    fn defaults_and_repeated_pools() {
        let cli = Cli::parse_from([
            "x",
            "--prefill",
            "http://127.0.0.1:1/",
            "--prefill",
            "http://127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
            "--conversation-ttl-secs",
            "0.5",
        ]);
        let cfg = cli.args.to_config().unwrap();
        assert_eq!(cli.args.port, 8000);
        assert_eq!(cli.args.host, "127.0.0.1");
        assert_eq!(cli.args.listen_addr(), "127.0.0.1:8000");
        let v6 = Cli::parse_from(["x", "--host", "::1", "--port", "9"]);
        assert_eq!(v6.args.listen_addr(), "[::1]:9");
        assert_eq!(cfg.prefill.len(), 2);
        assert_eq!(cfg.decode_retries, 1);
        assert_eq!(cfg.conversation_ttl, Duration::from_millis(500));
        assert!(cfg.upstream_idle_timeout < Duration::from_secs(5));
        assert_eq!(cfg.prefill[0].as_str(), "http://127.0.0.1:1/");
    }

    #[test]
    fn rejects_half_a_disaggregated_pair_and_bad_urls() {
        let cli = Cli::parse_from(["x", "--prefill", "http://127.0.0.1:1"]);
        assert!(cli.args.to_config().is_err());
        let cli = Cli::parse_from(["x", "--worker", "ftp://h"]);
        assert!(cli.args.to_config().is_err());
        let cli = Cli::parse_from(["x", "--worker", "http://127.0.0.1:9"]);
        assert!(cli.args.to_config().is_ok());
    }
}
