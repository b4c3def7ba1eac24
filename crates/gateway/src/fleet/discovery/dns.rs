//! `--discover-dns ROLE=NAME:PORT`: the workers at every address a name resolves to (a
//! headless Service's pods, a round-robin record), looked up every `--discover-interval`.
//! An answer with no addresses (NXDOMAIN, no A/AAAA records) means the name has no
//! workers now; a lookup that fails (timeout, SERVFAIL, no server) keeps the name's
//! addresses from its last answer, so a DNS outage never empties the fleet.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use reqwest::Url;

use super::Discoverer;
use super::DnsTarget;
use crate::fleet::registry::{WorkerSource, WorkerSpec};

/// What one lookup of a name found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The name's addresses now (empty: it has none).
    Addresses(BTreeSet<IpAddr>),
    /// The lookup failed; the name's last addresses stand.
    Failed(String),
}

/// Resolves every target each `--discover-interval` and applies the addresses when they
/// changed.
pub async fn watch(state: Arc<Discoverer>, targets: Vec<DnsTarget>, server: Option<SocketAddr>) {
    let mut ticks = tokio::time::interval(state.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resolver = None;
    // Each target's addresses from its last answer (`None`: never answered).
    let mut known: Vec<Option<BTreeSet<IpAddr>>> = vec![None; targets.len()];
    let mut applied: Option<Vec<WorkerSpec>> = None;
    loop {
        ticks.tick().await;
        if resolver.is_none() {
            match build_resolver(server, state.check.timeout) {
                Ok(built) => resolver = Some(built),
                Err(why) => {
                    super::failed(&state, WorkerSource::Dns, &why);
                    continue;
                }
            }
        }
        let resolver = resolver.as_ref().expect("built above");
        let answers =
            futures::future::join_all(targets.iter().map(|t| lookup(resolver, &t.name))).await;
        for ((target, answer), known) in targets.iter().zip(answers).zip(known.iter_mut()) {
            match answer {
                Answer::Addresses(addresses) => *known = Some(addresses),
                Answer::Failed(why) => super::failed(
                    &state,
                    WorkerSource::Dns,
                    &format!("{}: {why}", target.name),
                ),
            }
        }
        let specs = workers(&targets, &known);
        if applied.as_ref() != Some(&specs) {
            super::apply(&state, WorkerSource::Dns, specs.clone()).await;
            applied = Some(specs);
        }
    }
}

/// The workers the targets' known addresses make, in a stable order.
pub fn workers(targets: &[DnsTarget], known: &[Option<BTreeSet<IpAddr>>]) -> Vec<WorkerSpec> {
    let mut specs: Vec<WorkerSpec> = Vec::new();
    for (target, addresses) in targets.iter().zip(known) {
        for ip in addresses.iter().flatten() {
            let url = Url::parse(&format!("http://{}", SocketAddr::new(*ip, target.port)))
                .expect("an address and a port make a URL");
            let spec = WorkerSpec::new(target.role, url);
            // Two names may share an address: the first target names it.
            if !specs.iter().any(|s| s.url == spec.url) {
                specs.push(spec);
            }
        }
    }
    specs
}

/// One lookup of `name`'s A and AAAA records.
pub async fn lookup(resolver: &TokioResolver, name: &str) -> Answer {
    match resolver.lookup_ip(name).await {
        Ok(found) => Answer::Addresses(found.iter().collect()),
        Err(e) if e.is_no_records_found() => Answer::Addresses(BTreeSet::new()),
        Err(e) => Answer::Failed(e.to_string()),
    }
}

/// A resolver asking `server`, or the servers of /etc/resolv.conf, with no answers kept
/// between looks (each look sees the records as they are now, whatever their TTL).
pub fn build_resolver(
    server: Option<SocketAddr>,
    timeout: Duration,
) -> Result<TokioResolver, String> {
    let provider = TokioRuntimeProvider::default();
    let mut builder = match server {
        Some(addr) => {
            let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
                .into_iter()
                .map(|mut c| {
                    c.port = addr.port();
                    c
                })
                .collect();
            let name_server = NameServerConfig::new(addr.ip(), true, connections);
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![name_server]),
                provider,
            )
        }
        None => TokioResolver::builder(provider)
            .map_err(|e| format!("cannot read the system's DNS configuration: {e}"))?,
    };
    let options = builder.options_mut();
    options.positive_max_ttl = Some(Duration::ZERO);
    options.negative_max_ttl = Some(Duration::ZERO);
    options.timeout = timeout;
    options.attempts = 1;
    builder
        .build()
        .map_err(|e| format!("cannot build a DNS resolver: {e}"))
}

#[cfg(test)]
mod tests {
    use pdserve_protocol::WorkerRole;

    use super::*;

    #[test]
    fn each_address_of_each_name_is_a_worker_and_unanswered_names_add_none() {
        let target = |role, name: &str, port| DnsTarget {
            role,
            name: name.into(),
            port,
        };
        let targets = [
            target(WorkerRole::Prefill, "p", 8100),
            target(WorkerRole::Decode, "d", 8200),
            target(WorkerRole::Decode, "never", 8200),
        ];
        let ips = |list: &[&str]| Some(list.iter().map(|s| s.parse().unwrap()).collect());
        let specs = workers(
            &targets,
            &[ips(&["10.0.0.2", "10.0.0.1"]), ips(&["fd00::1"]), None],
        );
        let urls: Vec<(WorkerRole, String)> = specs.iter().map(|s| (s.role, s.key())).collect();
        assert_eq!(
            urls,
            vec![
                (WorkerRole::Prefill, "http://10.0.0.1:8100".to_string()),
                (WorkerRole::Prefill, "http://10.0.0.2:8100".to_string()),
                (WorkerRole::Decode, "http://[fd00::1]:8200".to_string()),
            ]
        );
    }
}
