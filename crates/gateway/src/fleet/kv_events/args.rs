//! The KV-event flags of `pdserve gateway`.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use crate::error::GatewayError;
use crate::fleet::registry::parse_worker_url;
use crate::fleet::registry::worker_key;

/// Flags naming workers' KV-event endpoints and bounding their indexes.
#[derive(Debug, Clone, clap::Args)]
pub struct KvEventsArgs {
    /// Subscribe to a worker's KV-cache events (vLLM's ZeroMQ publisher, or a pdserve
    /// worker's --kv-events-config): `WORKER_URL=tcp://host:port`; repeat per worker.
    /// Workers registered, listed or annotated with a `kv_events_endpoint` need no flag.
    #[arg(
        long = "kv-events",
        env = "PDSERVE_KV_EVENTS",
        value_delimiter = ',',
        value_name = "WORKER_URL=ENDPOINT"
    )]
    pub kv_events: Vec<String>,

    /// Collect KV-cache events on one ZeroMQ SUB socket bound here (llm-d's central
    /// collector): `tcp://HOST:PORT` (`tcp://*:PORT`: every interface) or `ipc:///PATH`.
    /// Every worker's publisher connects to it (vLLM and pdserve workers: a concrete
    /// `endpoint` in `--kv-events-config`, e.g. `tcp://GATEWAY_HOST:5557`) and sets the
    /// `topic` `kv@HOST:PORT@MODEL`: its events then go to the registered worker whose URL
    /// has that host and port. Messages of other topics are counted
    /// (pdserve_gateway_kv_events_unknown_topic_total) and dropped. Works alongside
    /// --kv-events (a subscribed worker's stream is its subscription).
    #[arg(
        long = "kv-events-bind",
        env = "PDSERVE_KV_EVENTS_BIND",
        value_name = "ENDPOINT"
    )]
    pub kv_events_bind: Option<String>,

    /// A worker's replay endpoint (vLLM's `replay_endpoint`), asked for missed batches
    /// after a sequence gap: `WORKER_URL=tcp://host:port`.
    #[arg(
        long = "kv-events-replay",
        env = "PDSERVE_KV_EVENTS_REPLAY",
        value_delimiter = ',',
        value_name = "WORKER_URL=ENDPOINT"
    )]
    pub kv_events_replay: Vec<String>,

    /// Most blocks indexed per worker; the least recently stored go first.
    #[arg(long, env = "PDSERVE_MAX_INDEXED_BLOCKS", default_value = "262144")]
    pub max_indexed_blocks: NonZeroUsize,

    /// A worker's index goes stale (routing falls back to the approximate tree for it)
    /// when it was sent prompts needing new blocks and no event arrived for this many
    /// seconds: the worker serves but its stream stopped. The next event revives it.
    #[arg(long, env = "PDSERVE_KV_EVENTS_STALE_SECS", default_value = "60", value_parser = positive_secs)]
    pub kv_events_stale_secs: f64,
}

fn positive_secs(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 => Ok(secs),
        _ => Err(format!(
            "expected a positive number of seconds, got `{raw}`"
        )),
    }
}

/// The resolved KV-event settings.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// Publisher endpoints by worker key.
    pub publishers: HashMap<String, String>,
    /// Where the collector binds (`--kv-events-bind`), if there is one.
    pub bind: Option<String>,
    /// Replay endpoints by worker key.
    pub replays: HashMap<String, String>,
    /// Blocks per worker index.
    pub max_indexed_blocks: NonZeroUsize,
    /// How long events may be owed before an index goes stale.
    pub stale_after: Duration,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            publishers: HashMap::new(),
            bind: None,
            replays: HashMap::new(),
            max_indexed_blocks: NonZeroUsize::new(262_144).expect("non-zero"),
            stale_after: Duration::from_secs(60),
        }
    }
}

impl KvEventsArgs {
    /// Validates the flags.
    pub fn to_config(&self) -> Result<KvEventsConfig, GatewayError> {
        Ok(KvEventsConfig {
            publishers: pairs("--kv-events", &self.kv_events)?,
            bind: match self.kv_events_bind.as_deref().map(str::trim) {
                None | Some("") => None,
                Some(endpoint) => {
                    check_endpoint(endpoint)
                        .map_err(|e| GatewayError::Config(format!("--kv-events-bind: {e}")))?;
                    Some(endpoint.to_string())
                }
            },
            replays: pairs("--kv-events-replay", &self.kv_events_replay)?,
            max_indexed_blocks: self.max_indexed_blocks,
            stale_after: Duration::from_secs_f64(self.kv_events_stale_secs),
        })
    }
}

/// `WORKER_URL=ENDPOINT` pairs by worker key.
fn pairs(flag: &str, raw: &[String]) -> Result<HashMap<String, String>, GatewayError> {
    let mut out = HashMap::new();
    for pair in raw.iter().filter(|p| !p.trim().is_empty()) {
        let (url, endpoint) = pair.trim().split_once('=').ok_or_else(|| {
            GatewayError::Config(format!(
                "{flag} `{pair}`: expected WORKER_URL=tcp://host:port"
            ))
        })?;
        let url = parse_worker_url(flag, url)?;
        check_endpoint(endpoint)
            .map_err(|e| GatewayError::Config(format!("{flag} `{pair}`: {e}")))?;
        out.insert(worker_key(&url), endpoint.to_string());
    }
    Ok(out)
}

/// Checks a KV-event publisher address: `tcp://host:port` or `ipc:///path` (a worker on
/// this machine), as vLLM's ZMQ endpoints are written.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if !path.is_empty() && path != "*" {
            return Ok(());
        }
    }
    let parsed = reqwest::Url::parse(endpoint).ok();
    match parsed {
        Some(url) if url.scheme() == "tcp" && url.host_str().is_some() && url.port().is_some() => {
            Ok(())
        }
        _ => Err(format!(
            "`kv_events_endpoint` must be tcp://host:port or ipc:///path, got `{endpoint}`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: KvEventsArgs,
    }

    fn config(argv: &[&str]) -> Result<KvEventsConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("gw").chain(argv.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.args.to_config().map_err(|e| e.to_string())
    }

    #[test]
    fn endpoints_pair_with_worker_urls() {
        let c = config(&[
            "--kv-events",
            "http://10.0.0.1:8000/=tcp://10.0.0.1:5557",
            "--kv-events-replay",
            "http://10.0.0.1:8000=tcp://10.0.0.1:5558",
            "--max-indexed-blocks",
            "1000",
            "--kv-events-stale-secs",
            "2.5",
        ])
        .unwrap();
        assert_eq!(c.publishers["http://10.0.0.1:8000"], "tcp://10.0.0.1:5557");
        assert_eq!(c.replays["http://10.0.0.1:8000"], "tcp://10.0.0.1:5558");
        assert_eq!(c.max_indexed_blocks.get(), 1000);
        assert_eq!(c.stale_after, Duration::from_millis(2500));
        assert_eq!(c.bind, None);
        let c = config(&["--kv-events-bind", "tcp://*:5557"]).unwrap();
        assert_eq!(c.bind.as_deref(), Some("tcp://*:5557"));
        let c = config(&["--kv-events-bind", "ipc:///run/kv.sock"]).unwrap();
        assert_eq!(c.bind.as_deref(), Some("ipc:///run/kv.sock"));
        for (bad, says) in [
            (&["--kv-events", "http://h:1"][..], "WORKER_URL="),
            (&["--kv-events", "http://h:1=h:5557"][..], "tcp://"),
            (&["--kv-events-bind", "tcp://h"][..], "--kv-events-bind"),
            (&["--kv-events-bind", "ipc://"][..], "ipc:///path"),
            (&["--kv-events", "ftp://h:1=tcp://h:5557"][..], "http://"),
            (&["--max-indexed-blocks", "0"][..], "0"),
            (&["--kv-events-stale-secs", "0"][..], "positive"),
        ] {
            let err = config(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }
}
