//! The central collector (llm-d's layout, `--kv-events-bind`): one SUB socket that this
//! gateway binds and every worker's publisher connects to. A message's topic says whose
//! it is, by llm-d's convention `kv@HOST:PORT@MODEL`: it belongs to the registered worker
//! whose URL has that host and port. Each such worker gets a stream of its own (sequence
//! checks, replay from `--kv-events-replay`, rebuilds), as a subscription would. A topic
//! that names no registered worker is counted
//! (`pdserve_gateway_kv_events_unknown_topic_total`), logged once at warn, and dropped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SubSocket};

use super::subscriber::{EventEndpoints, Stream};
use super::KvEventsHub;
use crate::error::GatewayError;
use crate::fleet::registry::Registry;

/// Topics warned about at most (past it, unknown topics are only counted).
const WARNED_TOPICS: usize = 1024;

/// The worker a topic names: `kv@HOST:PORT@MODEL` gives `(HOST, PORT)` (an IPv6 host
/// without its brackets, lowercased).
pub fn topic_address(topic: &str) -> Option<(String, u16)> {
    let mut parts = topic.splitn(3, '@');
    let (Some("kv"), Some(address), Some(_model)) = (parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let (host, port) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return None;
    }
    Some((host.to_ascii_lowercase(), port.parse().ok()?))
}

/// The registered worker (its key) at `host:port`, if there is one.
fn worker_at(registry: &Registry, host: &str, port: u16) -> Option<String> {
    registry.snapshot().members().iter().find_map(|m| {
        let url = &m.worker.spec.url;
        let url_host = url
            .host_str()?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        (url_host == host && url.port_or_known_default() == Some(port))
            .then(|| m.worker.base.clone())
    })
}

/// The address to bind for `endpoint`: ZeroMQ's wildcard host `*` is every IPv4
/// interface.
fn bind_address(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// Binds the collector's socket at `endpoint` and collects into `hub` until aborted;
/// returns the bound endpoint and the task.
pub async fn start(
    endpoint: &str,
    hub: Arc<KvEventsHub>,
    registry: Arc<Registry>,
) -> Result<(String, JoinHandle<()>), GatewayError> {
    let mut socket = SubSocket::new();
    let cannot = |e: zeromq::ZmqError| {
        GatewayError::Config(format!("--kv-events-bind `{endpoint}`: cannot bind: {e}"))
    };
    let bound = socket
        .bind(&bind_address(endpoint))
        .await
        .map_err(cannot)?
        .to_string();
    socket.subscribe("").await.map_err(cannot)?;
    tracing::info!(endpoint = %bound, "collecting KV events (topics kv@HOST:PORT@MODEL name the workers)");
    let collector = Collector {
        bound: bound.clone(),
        hub,
        registry,
        streams: HashMap::new(),
        warned: HashSet::new(),
    };
    Ok((bound, tokio::spawn(collector.run(socket))))
}

struct Collector {
    bound: String,
    hub: Arc<KvEventsHub>,
    registry: Arc<Registry>,
    /// A stream per worker heard from, by worker key.
    streams: HashMap<String, Stream>,
    /// Topics already warned about.
    warned: HashSet<String>,
}

impl Collector {
    async fn run(mut self, mut socket: SubSocket) {
        let stale_after = self.hub.config.stale_after;
        let check_every = (stale_after / 4).min(Duration::from_secs(1));
        let mut stale_check = tokio::time::interval(check_every);
        stale_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                received = socket.recv() => match received {
                    Ok(message) => self.receive(message.into_vec()).await,
                    Err(e) => {
                        self.hub.metrics.error("(collector)", "receive");
                        tracing::warn!(endpoint = %self.bound, "KV events collector: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = stale_check.tick() => {
                    // Workers that left the roster take their streams with them.
                    let hub = &self.hub;
                    self.streams.retain(|url, s| {
                        hub.worker(url).is_some_and(|e| Arc::ptr_eq(s.events(), &e))
                    });
                    for stream in self.streams.values() {
                        stream.check_stale();
                    }
                }
            }
        }
    }

    async fn receive(&mut self, frames: Vec<Bytes>) {
        let Some(topic) = frames.first() else {
            return;
        };
        let topic = String::from_utf8_lossy(topic).into_owned();
        let worker =
            topic_address(&topic).and_then(|(host, port)| worker_at(&self.registry, &host, port));
        let Some(worker) = worker else {
            self.hub.metrics.unknown_topic();
            if self.warned.len() < WARNED_TOPICS && self.warned.insert(topic.clone()) {
                tracing::warn!(
                    %topic,
                    "KV events: the topic names no registered worker (kv@HOST:PORT@MODEL, the \
                     worker's URL host and port); its events are dropped"
                );
            }
            return;
        };
        let Some(events) = self.hub.collected(&worker) else {
            // The worker has a subscription of its own (--kv-events, its registration):
            // that stream fills its index.
            self.hub.metrics.error(&worker, "duplicate");
            if self.warned.insert(topic.clone()) {
                tracing::warn!(%topic, %worker, "KV events: the worker is subscribed to as well; its collected events are dropped");
            }
            return;
        };
        let current = self
            .streams
            .get(&worker)
            .is_some_and(|s| Arc::ptr_eq(s.events(), &events));
        if !current {
            // First heard, or the worker left and came back: a new index, a new stream.
            let endpoints = EventEndpoints {
                publisher: format!("{} (topic {topic})", self.bound),
                replay: self.hub.config.replays.get(&worker).cloned(),
            };
            tracing::info!(%worker, %topic, "KV events: collecting the worker's events");
            let stream = Stream::new(
                worker.clone(),
                endpoints,
                events,
                self.hub.metrics.clone(),
                self.hub.config.stale_after,
            );
            self.streams.insert(worker.clone(), stream);
        }
        if let Some(stream) = self.streams.get_mut(&worker) {
            stream.receive_frames(frames).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_name_host_and_port_as_llm_d_writes_them() {
        assert_eq!(
            topic_address("kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"),
            Some(("10.0.0.5".into(), 8000))
        );
        assert_eq!(topic_address("kv@[::1]:8100@m"), Some(("::1".into(), 8100)));
        assert_eq!(
            topic_address("kv@Worker-0.svc:80@m@with-at"),
            Some(("worker-0.svc".into(), 80))
        );
        for bad in [
            "",
            "kv",
            "kv@10.0.0.5:8000",
            "kv@10.0.0.5@m",
            "kv@:8000@m",
            "kv@h:notaport@m",
            "events@h:1@m",
        ] {
            assert_eq!(topic_address(bad), None, "{bad}");
        }
    }
}
