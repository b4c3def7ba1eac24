//! Which hosts a worker exchanges KV blocks with (`--kv-peers`): addresses, CIDR ranges
//! and host names. Checked on both sides: a reader connects only to allowed hosts, and
//! a server answers only connections from allowed addresses.

use std::net::IpAddr;

use ipnet::IpNet;

/// An allow-list of KV peers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerAllowList {
    nets: Vec<IpNet>,
    /// Host names, lower-cased.
    hosts: Vec<String>,
}

/// An allow-list entry that is neither an address, a CIDR range nor a host name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid KV peer {0:?}: expected an IP address, a CIDR range (e.g. 127.0.0.0/8) or a host name"
)]
pub struct InvalidPeer(pub String);

impl PeerAllowList {
    /// Loopback only: `127.0.0.0/8`, `::1` and `localhost`.
    pub fn loopback() -> Self {
        let mut list = Self::default();
        for entry in ["127.0.0.0/8", "::1", "localhost"] {
            list.add(entry).expect("valid loopback entries");
        }
        list
    }

    /// Adds an IP address, a CIDR range or a host name (a bracketed IPv6 literal too).
    pub fn add(&mut self, entry: &str) -> Result<(), InvalidPeer> {
        let entry = entry.trim();
        let bare = entry.trim_start_matches('[').trim_end_matches(']');
        let net = match (bare.parse::<IpNet>(), bare.parse::<IpAddr>()) {
            (Ok(net), _) => Some(net.trunc()),
            (_, Ok(ip)) => Some(IpNet::from(ip.to_canonical())),
            _ => None,
        };
        if let Some(net) = net {
            if !self.nets.contains(&net) {
                self.nets.push(net);
            }
        } else if is_host_name(entry) {
            let host = entry.to_ascii_lowercase();
            if !self.hosts.contains(&host) {
                self.hosts.push(host);
            }
        } else {
            return Err(InvalidPeer(entry.to_string()));
        }
        Ok(())
    }

    /// Whether a reader may connect to `host` (a `remote_host`): an address inside an
    /// allowed range, or exactly an allowed host name. Nothing is resolved, so the answer
    /// says nothing about the network.
    pub fn allows_host(&self, host: &str) -> bool {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<IpAddr>() {
            Ok(ip) => self.contains_ip(ip),
            Err(_) => self.hosts.contains(&bare.to_ascii_lowercase()),
        }
    }

    /// Whether a reader may connect to `host`, also accepting an address that an allowed
    /// host name resolves to now (a headless Kubernetes Service naming the peer pods).
    /// Only the operator's names are resolved, never `host` itself.
    pub async fn allows_dialling(&self, host: &str) -> bool {
        if self.allows_host(host) {
            return true;
        }
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<IpAddr>() {
            Ok(ip) => self.allows_addr(ip).await,
            Err(_) => false,
        }
    }

    /// Whether a connection from `ip` may be served: inside an allowed range, or an
    /// address an allowed host name resolves to now.
    pub async fn allows_addr(&self, ip: IpAddr) -> bool {
        if self.contains_ip(ip) {
            return true;
        }
        let ip = ip.to_canonical();
        for host in &self.hosts {
            if let Ok(addrs) = tokio::net::lookup_host((host.as_str(), 0)).await {
                if addrs.into_iter().any(|a| a.ip().to_canonical() == ip) {
                    return true;
                }
            }
        }
        false
    }

    fn contains_ip(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|n| n.contains(&ip))
    }
}

impl std::fmt::Display for PeerAllowList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nets = self.nets.iter().map(ToString::to_string);
        let all: Vec<String> = nets.chain(self.hosts.iter().cloned()).collect();
        f.write_str(&all.join(","))
    }
}

/// RFC 1123 host names (labels of letters, digits and hyphens, dot-separated).
fn is_host_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn addresses_ranges_and_names_are_matched_exactly() {
        let list = PeerAllowList::loopback();
        for host in ["127.0.0.1", "::1", "[::1]", "localhost", "LocalHost"] {
            assert!(list.allows_host(host), "{host}");
        }
        assert!(list.allows_addr("127.0.0.1".parse().unwrap()).await);
        assert!(list.allows_addr("::ffff:127.0.0.1".parse().unwrap()).await);

        // Neither the v4 loopback nor a name is in a list of `::1` alone.
        let mut only_v6 = PeerAllowList::default();
        only_v6.add("::1").unwrap();
        for host in ["127.0.0.1", "localhost", "0.0.0.0", ""] {
            assert!(!only_v6.allows_host(host), "{host}");
        }
        assert!(!only_v6.allows_addr("127.0.0.1".parse().unwrap()).await);
        assert_eq!(only_v6.to_string(), "::1/128");

        // A range and a name given explicitly.
        let mut explicit = PeerAllowList::default();
        explicit.add("127.0.0.1/32").unwrap();
        explicit.add("LOCALHOST").unwrap();
        assert!(explicit.allows_host("127.0.0.1") && explicit.allows_host("localhost"));
        assert!(!explicit.allows_host("::1"));
        // A name allows the addresses it resolves to (localhost: loopback).
        let mut by_name = PeerAllowList::default();
        by_name.add("localhost").unwrap();
        assert!(
            !by_name.allows_host("127.0.0.1"),
            "nothing resolved for dialling"
        );
        assert!(by_name.allows_addr("127.0.0.1".parse().unwrap()).await);
        // Dialling an address an allowed name resolves to is allowed; the dialled host
        // itself is never resolved (a name not on the list stays refused).
        assert!(by_name.allows_dialling("127.0.0.1").await);
        assert!(!by_name.allows_dialling("localhost.invalid").await);
        let mut other = PeerAllowList::default();
        other.add("::1").unwrap();
        assert!(!other.allows_dialling("127.0.0.1").await);

        for bad in [
            "a b",
            "127.0.0.1/40",
            "-x",
            "http://127.0.0.1:1",
            "localhost:1",
        ] {
            assert!(PeerAllowList::default().add(bad).is_err(), "{bad}");
        }
    }
}
