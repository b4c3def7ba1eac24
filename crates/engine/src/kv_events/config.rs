//! `--kv-events-config`: vLLM's `KVEventsConfig` keys, as JSON, so a launcher that
//! configures vLLM's event publisher configures this one the same way.

use serde::Deserialize;

/// How (and whether) the worker publishes KV-cache events.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Publish events at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset: `"zmq"` when enabled.
    pub publisher: Option<String>,
    /// The PUB socket, by vLLM's rule ([`KvEventsConfig::binds`]): `tcp://*:5557` (a
    /// wildcard: every interface), an IPv6 address with `::`, or `ipc:///path` binds; any
    /// other `tcp://host:port` connects, to a collector that binds there (a gateway's
    /// `--kv-events-bind`).
    pub endpoint: String,
    /// The ROUTER socket that answers replay requests (always bound); none: no replay.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// High-water mark of the PUB socket, in messages per subscriber.
    pub hwm: usize,
    /// Batches waiting to be published, at most; past it new ones are dropped (and
    /// counted), so a stalled publisher never stalls the scheduler.
    pub max_queue_size: usize,
    /// The first frame of every message. A gateway collecting many workers' events on
    /// one socket attributes them by llm-d's convention `kv@HOST:PORT@MODEL` (the
    /// worker's HTTP address and served model).
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Parses the JSON of `--kv-events-config`; `None` when events are off.
    pub fn parse(json: &str) -> Result<Option<Self>, String> {
        let config: Self = serde_json::from_str(json)
            .map_err(|e| format!("--kv-events-config is not vLLM's KVEventsConfig JSON: {e}"))?;
        let publisher = config
            .publisher
            .as_deref()
            .unwrap_or(if config.enable_kv_cache_events {
                "zmq"
            } else {
                "null"
            });
        match publisher {
            "null" => return Ok(None),
            "zmq" => {}
            other => {
                return Err(format!(
                    "--kv-events-config: publisher `{other}` is not one of zmq, null"
                ))
            }
        }
        if !config.enable_kv_cache_events {
            return Err(
                "--kv-events-config: publisher zmq needs \"enable_kv_cache_events\": true".into(),
            );
        }
        for (key, endpoint) in [
            ("endpoint", Some(&config.endpoint)),
            ("replay_endpoint", config.replay_endpoint.as_ref()),
        ] {
            if let Some(endpoint) = endpoint {
                check_endpoint(endpoint).map_err(|e| format!("--kv-events-config: {key} {e}"))?;
            }
        }
        if config.buffer_steps == 0 && config.replay_endpoint.is_some() {
            return Err("--kv-events-config: replay needs buffer_steps > 0".into());
        }
        if config.max_queue_size == 0 || config.hwm == 0 {
            return Err("--kv-events-config: max_queue_size and hwm must be positive".into());
        }
        Ok(Some(config))
    }

    /// Whether the PUB socket binds, by vLLM's rule (`ZmqEventPublisher._is_bind_endpoint`):
    /// an endpoint containing `*` or `::`, or an `ipc://` or `inproc://` endpoint, binds;
    /// any other connects. (The replay socket always binds.)
    pub fn binds(&self) -> bool {
        is_bind_endpoint(&self.endpoint)
    }
}

/// vLLM's `_is_bind_endpoint`: wildcards, IPv6 `::` addresses and local transports bind.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// A `tcp://host:port` or `ipc:///path` endpoint; `inproc://` (the same process only) and
/// other schemes say why not.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() || path == "*" {
            return Err(format!("`{endpoint}` needs a socket path (ipc:///path)"));
        }
        return Ok(());
    }
    if endpoint.starts_with("inproc://") {
        return Err(format!(
            "`{endpoint}`: inproc:// reaches only sockets of the same process, and no \
             subscriber lives in the worker's (use ipc:///path or tcp://host:port)"
        ));
    }
    let Some(address) = endpoint.strip_prefix("tcp://") else {
        return Err(format!(
            "`{endpoint}` must be tcp://host:port or ipc:///path"
        ));
    };
    match address.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(format!(
            "`{endpoint}` must be tcp://host:port or ipc:///path"
        )),
    }
}

/// The address to bind for `endpoint`: ZeroMQ's wildcard host `*` is every IPv4
/// interface (`0.0.0.0`), which the socket library needs spelled out.
pub fn bind_address(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_style_configs_parse_and_wrong_ones_say_why() {
        let on = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, "topic": "kv"}"#,
        )
        .unwrap()
        .unwrap();
        assert!(on.binds());
        assert_eq!(on.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert_eq!((on.buffer_steps, on.topic.as_str()), (100, "kv"));
        let implied = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#)
            .unwrap()
            .unwrap();
        assert_eq!(implied.endpoint, "tcp://*:5557");
        assert!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": false}"#)
                .unwrap()
                .is_none()
        );
        assert!(KvEventsConfig::parse(r#"{"publisher": "null"}"#)
            .unwrap()
            .is_none());
        // vLLM's rule, case by case: wildcards, `::` and local transports bind; every
        // other endpoint connects, loopback included.
        for (endpoint, binds) in [
            ("tcp://*:5557", true),
            ("tcp://*:0", true),
            ("tcp://[::]:5557", true),
            ("tcp://[::1]:5557", true),
            ("ipc:///tmp/kv.sock", true),
            ("inproc://kv", true),
            ("tcp://127.0.0.1:5557", false),
            ("tcp://localhost:5557", false),
            ("tcp://0.0.0.0:5557", false),
            ("tcp://10.0.0.1:5557", false),
            ("tcp://gateway.example:5557", false),
        ] {
            let c = KvEventsConfig {
                endpoint: endpoint.into(),
                ..KvEventsConfig::default()
            };
            assert_eq!(c.binds(), binds, "{endpoint}");
        }
        assert_eq!(bind_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_address("tcp://[::]:5557"), "tcp://[::]:5557");
        assert_eq!(bind_address("ipc:///tmp/x"), "ipc:///tmp/x");
        let ipc = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv.sock",
                "replay_endpoint": "ipc:///tmp/kv-replay.sock"}"#,
        )
        .unwrap()
        .unwrap();
        assert!(ipc.binds());
        for (bad, says) in [
            ("{", "KVEventsConfig"),
            (
                r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
                "kafka",
            ),
            (r#"{"publisher": "zmq"}"#, "enable_kv_cache_events"),
            (
                r#"{"enable_kv_cache_events": true, "endpoint": "inproc://kv"}"#,
                "inproc",
            ),
            (
                r#"{"enable_kv_cache_events": true, "endpoint": "udp://h:1"}"#,
                "tcp://host:port or ipc",
            ),
            (
                r#"{"enable_kv_cache_events": true, "replay_endpoint": "tcp://h"}"#,
                "replay_endpoint",
            ),
            (
                r#"{"enable_kv_cache_events": true, "bufer_steps": 3}"#,
                "bufer_steps",
            ),
            (r#"{"enable_kv_cache_events": true, "hwm": 0}"#, "hwm"),
        ] {
            let err = KvEventsConfig::parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
