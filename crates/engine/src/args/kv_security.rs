//! Who this worker exchanges KV with: the `--kv-peers` allow-list (default: loopback,
//! this worker's own addresses and its `--prefill` workers) and the shared transfer
//! secret (`PDSERVE_KV_SECRET`).

use pdserve_kv_transfer::{PeerAllowList, TransferSecret};

use super::WorkerArgs;

/// The allow-list `args` configure: `--kv-peers` when given (exactly those), else
/// loopback plus the hosts this worker is told about (`--host`, `--kv-host`, the hosts
/// of `--prefill` URLs).
pub fn peers_from_args(args: &WorkerArgs) -> Result<PeerAllowList, String> {
    let mut peers = PeerAllowList::default();
    if !args.kv_peers.is_empty() {
        for entry in args.kv_peers.iter().filter(|e| !e.trim().is_empty()) {
            peers.add(entry).map_err(|e| format!("--kv-peers: {e}"))?;
        }
        return Ok(peers);
    }
    peers = PeerAllowList::loopback();
    let own = [Some(args.host.as_str()), args.kv_host.as_deref()];
    let prefill = args.prefill.iter().filter_map(|u| url_host(u));
    for host in own.into_iter().flatten().chain(prefill) {
        // A wildcard listen address is no peer; unparsable hosts are refused elsewhere.
        if !matches!(host, "0.0.0.0" | "::" | "[::]" | "") {
            let _ = peers.add(host);
        }
    }
    Ok(peers)
}

/// The shared secret `args` configure, if any.
pub fn secret_from_args(args: &WorkerArgs) -> Option<TransferSecret> {
    args.kv_secret.clone().and_then(TransferSecret::new)
}

/// The host of an `http://host:port` URL.
fn url_host(url: &str) -> Option<&str> {
    let rest = url.trim().strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next();
    }
    authority
        .rsplit_once(':')
        .map_or(Some(authority), |(h, _)| Some(h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    use crate::args::WorkerCli;

    fn args(argv: &[&str]) -> WorkerArgs {
        let argv = std::iter::once("worker").chain(argv.iter().copied());
        WorkerCli::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn default_peers_are_loopback_and_configured_hosts_only() {
        let peers = peers_from_args(&args(&["--kv-peers", "::1"])).unwrap();
        assert!(
            !peers.allows_host("127.0.0.1"),
            "explicit list replaces the default"
        );
        let peers = peers_from_args(&args(&[])).unwrap();
        assert!(peers.allows_host("127.0.0.1") && peers.allows_host("::1"));
        assert!(peers.allows_host("localhost"));
        // The hosts of --prefill URLs are added (here a name and a bracketed v6 literal).
        assert_eq!(url_host("http://localhost:8100"), Some("localhost"));
        assert_eq!(url_host("http://[::1]:8100"), Some("::1"));
        assert_eq!(url_host("http://127.0.0.1:8100/"), Some("127.0.0.1"));
        let list = |argv: &[&str]| peers_from_args(&args(argv)).unwrap().to_string();
        // A wildcard --host is no peer; a --prefill host is one.
        assert_eq!(
            list(&["--role", "decode", "--host", "0.0.0.0"]),
            "127.0.0.0/8,::1/128,localhost"
        );
        assert_eq!(
            list(&[
                "--role",
                "decode",
                "--host",
                "0.0.0.0",
                "--prefill",
                "http://127.0.0.1:8100"
            ]),
            "127.0.0.0/8,::1/128,127.0.0.1/32,localhost"
        );
        assert_eq!(
            list(&["--host", "0.0.0.0", "--kv-host", "127.0.0.1"]),
            "127.0.0.0/8,::1/128,127.0.0.1/32,localhost"
        );
    }

    #[test]
    fn explicit_peers_are_parsed_and_bad_entries_refused() {
        let peers = peers_from_args(&args(&[
            "--kv-peers",
            "::1",
            "--kv-peers",
            "127.0.0.1/32,localhost",
        ]));
        let peers = peers.unwrap();
        assert!(peers.allows_host("::1") && peers.allows_host("127.0.0.1"));
        assert!(peers.allows_host("localhost"));
        let err = peers_from_args(&args(&["--kv-peers", "not a host"])).unwrap_err();
        assert!(err.contains("--kv-peers"), "{err}");
        assert!(secret_from_args(&args(&[])).is_none());
        assert!(secret_from_args(&args(&["--kv-secret", ""])).is_none());
        let secret = secret_from_args(&args(&["--kv-secret", "s"])).unwrap();
        assert!(secret.verify(Some("s")));
    }
}
