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
    /// The PUB socket: `tcp://*:5557` (a wildcard) binds, as vLLM does, and so does a
    /// loopback address (`tcp://127.0.0.1:5557`: only this machine may listen); any other
    /// `tcp://host:port` connects (to a collector that binds).
    pub endpoint: String,
    /// The ROUTER socket that answers replay requests (bound); none: no replay.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// High-water mark of the PUB socket, in messages per subscriber.
    pub hwm: usize,
    /// Batches waiting to be published, at most; past it new ones are dropped (and
    /// counted), so a stalled publisher never stalls the scheduler.
    pub max_queue_size: usize,
    /// The first frame of every message.
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
                if !endpoint.starts_with("tcp://") {
                    return Err(format!(
                        "--kv-events-config: {key} `{endpoint}` must be tcp://host:port \
                         (ipc:// and inproc:// are not supported)"
                    ));
                }
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

    /// Whether the PUB socket binds: vLLM's rule (a wildcard address binds), and a
    /// loopback address, which no collector elsewhere could be listening on.
    pub fn binds(&self) -> bool {
        let host = self
            .endpoint
            .trim_start_matches("tcp://")
            .rsplit_once(':')
            .map_or("", |(host, _)| host)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let loopback = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
        self.endpoint.contains('*') || self.endpoint.contains("::") || loopback
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
        let connects = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:5557"}"#,
        )
        .unwrap()
        .unwrap();
        assert!(!connects.binds());
        for local in [
            "tcp://127.0.0.1:5557",
            "tcp://[::1]:5557",
            "tcp://localhost:1",
            "tcp://0.0.0.0:2",
        ] {
            let c = KvEventsConfig {
                endpoint: local.into(),
                ..KvEventsConfig::default()
            };
            assert!(c.binds(), "{local}");
        }
        for (bad, says) in [
            ("{", "KVEventsConfig"),
            (
                r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
                "kafka",
            ),
            (r#"{"publisher": "zmq"}"#, "enable_kv_cache_events"),
            (
                r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}"#,
                "ipc",
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
