//! Bootstrap metrics (`pdserve_bootstrap_*`); all zero on a worker that never saw a
//! `bootstrap_room`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels naming how a room ended.
pub type OutcomeLabels = Vec<(&'static str, &'static str)>;

/// What the bootstrap rendezvous counts.
#[derive(Debug, Default)]
pub struct BootstrapMetrics {
    /// Rooms this prefill worker tracks now (a prefill or a decode read is on them).
    pub rooms_open: Gauge,
    /// Rooms closed, by outcome: `transferred` (the decode worker read the KV),
    /// `unclaimed` (no decode worker came in time), `unfilled` (no prefill came in time,
    /// or it ended without KV), `failed` (the transfer broke off).
    pub rooms: Family<OutcomeLabels, Counter>,
    /// Decode-side rendezvous by outcome (`ok`, `failed`, `timeout`).
    pub rendezvous: Family<OutcomeLabels, Counter>,
}

impl BootstrapMetrics {
    /// Counts one room closed with `outcome`.
    pub fn room_closed(&self, outcome: &'static str) {
        self.rooms.get_or_create(&vec![("outcome", outcome)]).inc();
    }

    /// Counts one decode-side rendezvous that ended with `outcome`.
    pub fn rendezvous(&self, outcome: &'static str) {
        self.rendezvous
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    /// Registers under `bootstrap_`.
    pub fn register(&self, r: &mut Registry) {
        let r = r.sub_registry_with_prefix("bootstrap");
        r.register(
            "rooms_open",
            "Bootstrap rooms open on this prefill worker",
            self.rooms_open.clone(),
        );
        r.register(
            "rooms",
            "Bootstrap rooms closed, by outcome",
            self.rooms.clone(),
        );
        r.register(
            "rendezvous",
            "Decode-side bootstrap rendezvous, by outcome",
            self.rendezvous.clone(),
        );
    }
}
