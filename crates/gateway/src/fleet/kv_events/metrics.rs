//! The KV-event subscribers' metrics, registered in the gateway's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    worker: String,
    kind: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    worker: String,
    outcome: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    worker: String,
    reason: String,
}

/// Counters and gauges of every worker's event stream and index.
#[derive(Debug)]
pub struct KvEventMetrics {
    events: Family<KindLabels, Counter>,
    index_blocks: Family<WorkerLabels, Gauge>,
    index_stale: Family<WorkerLabels, Gauge>,
    gaps: Family<WorkerLabels, Counter>,
    replays: Family<OutcomeLabels, Counter>,
    rebuilds: Family<ReasonLabels, Counter>,
    errors: Family<KindLabels, Counter>,
    unknown_topics: Counter,
}

impl KvEventMetrics {
    /// Registers the families in `registry` (prefix `pdserve_gateway`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            events: Family::default(),
            index_blocks: Family::default(),
            index_stale: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            rebuilds: Family::default(),
            errors: Family::default(),
            unknown_topics: Counter::default(),
        };
        registry.register(
            "kv_events",
            "KV-cache events received from workers, by kind (block_stored, block_removed, \
             all_blocks_cleared; skipped: unknown tags or unreadable events)",
            metrics.events.clone(),
        );
        registry.register(
            "kv_index_blocks",
            "Blocks in each worker's KV index (what its events say it caches)",
            metrics.index_blocks.clone(),
        );
        registry.register(
            "kv_index_stale",
            "1 while a worker's KV index is stale (events owed longer than \
             --kv-events-stale-secs; routing falls back for it), else 0",
            metrics.index_stale.clone(),
        );
        registry.register(
            "kv_event_gaps",
            "Sequence gaps in a worker's event stream (missed batches)",
            metrics.gaps.clone(),
        );
        registry.register(
            "kv_event_replays",
            "Replays asked of a worker's replay socket, by outcome (filled, incomplete, failed)",
            metrics.replays.clone(),
        );
        registry.register(
            "kv_index_rebuilds",
            "A worker's KV index cleared and rebuilt from new events, by reason (gap: a gap \
             replay could not fill; restart: the publisher's sequence went back; block_size: \
             the block size changed; stale: no events while the worker served)",
            metrics.rebuilds.clone(),
        );
        registry.register(
            "kv_events_unknown_topic",
            "Messages on the --kv-events-bind collector whose topic names no registered \
             worker (llm-d's kv@HOST:PORT@MODEL, the worker's URL host and port); dropped",
            metrics.unknown_topics.clone(),
        );
        registry.register(
            "kv_event_errors",
            "Event-stream failures, by kind (connect, receive, frames, payload; duplicate: \
             collected events of a worker that is subscribed to as well, dropped)",
            metrics.errors.clone(),
        );
        metrics
    }

    fn worker(worker: &str) -> WorkerLabels {
        WorkerLabels {
            worker: worker.to_string(),
        }
    }

    fn kind(worker: &str, kind: &str) -> KindLabels {
        KindLabels {
            worker: worker.to_string(),
            kind: kind.to_string(),
        }
    }

    /// One event received.
    pub fn event(&self, worker: &str, kind: &str) {
        self.events.get_or_create(&Self::kind(worker, kind)).inc();
    }

    /// The worker's index size.
    pub fn set_blocks(&self, worker: &str, blocks: usize) {
        self.index_blocks
            .get_or_create(&Self::worker(worker))
            .set(blocks as i64);
    }

    /// Whether the worker's index is stale.
    pub fn set_stale(&self, worker: &str, stale: bool) {
        self.index_stale
            .get_or_create(&Self::worker(worker))
            .set(i64::from(stale));
    }

    /// A sequence gap.
    pub fn gap(&self, worker: &str) {
        self.gaps.get_or_create(&Self::worker(worker)).inc();
    }

    /// A replay and how it went.
    pub fn replay(&self, worker: &str, outcome: &str) {
        self.replays
            .get_or_create(&OutcomeLabels {
                worker: worker.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// An index cleared, and why.
    pub fn rebuild(&self, worker: &str, reason: &str) {
        self.rebuilds
            .get_or_create(&ReasonLabels {
                worker: worker.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// A stream failure.
    pub fn error(&self, worker: &str, kind: &str) {
        self.errors.get_or_create(&Self::kind(worker, kind)).inc();
    }

    /// A collected message whose topic names no registered worker.
    pub fn unknown_topic(&self) {
        self.unknown_topics.inc();
    }

    /// Drops a removed worker's index gauge (its counters stay, as totals do).
    pub fn forget(&self, worker: &str) {
        self.index_blocks.remove(&Self::worker(worker));
        self.index_stale.remove(&Self::worker(worker));
    }
}
