//! The discovery flags of `pdserve gateway` and the configuration they resolve to. The
//! Kubernetes flags carry SGLang's gateway's and vllm-router's names, so their users'
//! manifests keep working.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pdserve_protocol::WorkerRole;

use crate::error::GatewayError;

/// SGLang's annotation for a prefill pod's bootstrap port.
pub const DEFAULT_BOOTSTRAP_PORT_ANNOTATION: &str = "sglang.ai/bootstrap-port";
/// The annotation giving a pod's data-parallel size (replicas behind its URL).
pub const DP_SIZE_ANNOTATION: &str = "pdserve.dev/dp-size";
/// The annotation giving a pod's HTTP port where it differs from
/// `--service-discovery-port` (hostNetwork pods sharing a node's IP).
pub const PORT_ANNOTATION: &str = "pdserve.dev/port";
/// The annotation naming the port of a pod's KV-event replay socket.
pub const KV_EVENTS_REPLAY_PORT_ANNOTATION: &str = "pdserve.dev/kv-events-replay-port";
/// The default annotation naming the port of a pod's KV-event publisher.
pub const DEFAULT_KV_EVENTS_PORT_ANNOTATION: &str = "pdserve.dev/kv-events-port";

/// Flags that find workers at run time instead of listing them at start.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryArgs {
    /// Discover workers from a YAML or JSON file (`workers:` list of `url`, `role` and
    /// optionally `dp_size`, `bootstrap_port`, `kv_events_endpoint`), re-read every
    /// --discover-interval; a file that cannot be read or parsed keeps the workers it
    /// listed last.
    #[arg(long, env = "PDSERVE_DISCOVER_FILE", value_name = "PATH")]
    pub discover_file: Option<PathBuf>,

    /// Discover workers by resolving a DNS name (a headless Service, or any name with
    /// many addresses) every --discover-interval: `ROLE=NAME:PORT`, e.g.
    /// `prefill=pdserve-prefill.default.svc.cluster.local:8100`; repeat per role or name.
    /// Addresses that vanish are removed and new ones added; a failed lookup keeps the
    /// addresses found last. Comma-separated in the environment variable.
    #[arg(
        long,
        env = "PDSERVE_DISCOVER_DNS",
        value_name = "ROLE=NAME:PORT",
        value_delimiter = ','
    )]
    pub discover_dns: Vec<String>,

    /// The DNS server --discover-dns asks (`IP:PORT`), instead of those in
    /// /etc/resolv.conf.
    #[arg(long, env = "PDSERVE_DISCOVER_DNS_SERVER", value_name = "IP:PORT")]
    pub discover_dns_server: Option<SocketAddr>,

    /// Seconds between two looks at a polled discovery source (file, DNS); Kubernetes is
    /// watched, not polled.
    #[arg(long, env = "PDSERVE_DISCOVER_INTERVAL", default_value = "5", value_parser = crate::flags::parse_secs)]
    pub discover_interval: Duration,

    /// Discover workers from Kubernetes pods (in-cluster service account, else
    /// --kubeconfig, $KUBECONFIG or ~/.kube/config). Pods matching --selector
    /// (prefill_decode), --prefill-selector, --decode-selector or --encode-selector are
    /// routed to while Running, Ready and not terminating. Needs get/list/watch on pods.
    #[arg(long, env = "PDSERVE_SERVICE_DISCOVERY")]
    pub service_discovery: bool,

    /// Labels (`key=value`, space- or comma-separated) of pods that do both prefill and
    /// decode (prefill_decode workers).
    #[arg(long, env = "PDSERVE_SELECTOR", num_args = 1.., value_delimiter = ',', value_name = "KEY=VALUE")]
    pub selector: Vec<String>,

    /// Labels of prefill worker pods.
    #[arg(long, env = "PDSERVE_PREFILL_SELECTOR", num_args = 1.., value_delimiter = ',', value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,

    /// Labels of decode worker pods.
    #[arg(long, env = "PDSERVE_DECODE_SELECTOR", num_args = 1.., value_delimiter = ',', value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,

    /// Labels of media encoder pods.
    #[arg(long, env = "PDSERVE_ENCODE_SELECTOR", num_args = 1.., value_delimiter = ',', value_name = "KEY=VALUE")]
    pub encode_selector: Vec<String>,

    /// The namespace whose pods are watched; unset: every namespace (which needs a
    /// ClusterRole; a namespaced Role needs this flag).
    #[arg(long, env = "PDSERVE_SERVICE_DISCOVERY_NAMESPACE")]
    pub service_discovery_namespace: Option<String>,

    /// The port of a discovered pod's HTTP server (`http://POD_IP:PORT`).
    #[arg(long, env = "PDSERVE_SERVICE_DISCOVERY_PORT", default_value_t = 8000)]
    pub service_discovery_port: u16,

    /// The pod annotation that holds a prefill pod's SGLang bootstrap port.
    #[arg(long, env = "PDSERVE_BOOTSTRAP_PORT_ANNOTATION", default_value = DEFAULT_BOOTSTRAP_PORT_ANNOTATION)]
    pub bootstrap_port_annotation: String,

    /// The pod annotation that holds the port of a pod's KV-event publisher
    /// (`tcp://POD_IP:PORT`).
    #[arg(long, env = "PDSERVE_KV_EVENTS_PORT_ANNOTATION", default_value = DEFAULT_KV_EVENTS_PORT_ANNOTATION)]
    pub kv_events_port_annotation: String,

    /// A kubeconfig file for --service-discovery, used instead of the in-cluster service
    /// account and $KUBECONFIG.
    #[arg(long, env = "PDSERVE_KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

/// One `--discover-dns` target: the workers of `role` at every address of `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsTarget {
    /// The role of every address found.
    pub role: WorkerRole,
    /// The name to resolve.
    pub name: String,
    /// The workers' HTTP port.
    pub port: u16,
}

/// A Kubernetes label selector: every `key=value` must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<(String, String)>);

impl LabelSelector {
    /// The selector in the API's `labelSelector` syntax (`k=v,k2=v2`).
    pub fn to_query(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `--service-discovery`'s settings.
#[derive(Debug, Clone)]
pub struct KubernetesDiscovery {
    /// One selector per role it discovers.
    pub selectors: Vec<(WorkerRole, LabelSelector)>,
    /// `None`: every namespace.
    pub namespace: Option<String>,
    /// The pods' HTTP port.
    pub port: u16,
    /// Annotation of a prefill pod's bootstrap port.
    pub bootstrap_port_annotation: String,
    /// Annotation of a pod's KV-event publisher port.
    pub kv_events_port_annotation: String,
    /// Explicit kubeconfig file.
    pub kubeconfig: Option<PathBuf>,
}

/// Every discovery source the gateway runs.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// `--discover-file`.
    pub file: Option<PathBuf>,
    /// `--discover-dns` targets.
    pub dns: Vec<DnsTarget>,
    /// `--discover-dns-server`.
    pub dns_server: Option<SocketAddr>,
    /// Time between two looks at a polled source.
    pub interval: Duration,
    /// `--service-discovery`.
    pub kubernetes: Option<KubernetesDiscovery>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            file: None,
            dns: Vec::new(),
            dns_server: None,
            interval: Duration::from_secs(5),
            kubernetes: None,
        }
    }
}

impl DiscoveryConfig {
    /// Whether any source may add workers after start (so a gateway with no static
    /// workers is not a mistake).
    pub fn any(&self) -> bool {
        self.file.is_some() || !self.dns.is_empty() || self.kubernetes.is_some()
    }
}

impl DiscoveryArgs {
    /// Validates the flags into a configuration.
    pub fn to_config(&self) -> Result<DiscoveryConfig, GatewayError> {
        let dns = self
            .discover_dns
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| parse_dns_target(s))
            .collect::<Result<Vec<_>, _>>()?;
        if self.discover_dns_server.is_some() && dns.is_empty() {
            return Err(config_error(
                "--discover-dns-server needs --discover-dns targets to resolve",
            ));
        }
        if self.discover_interval.is_zero() {
            return Err(config_error("--discover-interval must be positive"));
        }
        let selectors = [
            (WorkerRole::PrefillDecode, "--selector", &self.selector),
            (
                WorkerRole::Prefill,
                "--prefill-selector",
                &self.prefill_selector,
            ),
            (
                WorkerRole::Decode,
                "--decode-selector",
                &self.decode_selector,
            ),
            (
                WorkerRole::Encode,
                "--encode-selector",
                &self.encode_selector,
            ),
        ]
        .into_iter()
        .filter(|(_, _, labels)| labels.iter().any(|l| !l.trim().is_empty()))
        .map(|(role, flag, labels)| Ok((role, parse_selector(flag, labels)?)))
        .collect::<Result<Vec<_>, GatewayError>>()?;
        let kubernetes = if self.service_discovery {
            if selectors.is_empty() {
                return Err(config_error(
                    "--service-discovery needs a pod selector: --selector (prefill_decode \
                     workers), or --prefill-selector and --decode-selector",
                ));
            }
            let has = |r| selectors.iter().any(|(role, _)| *role == r);
            if has(WorkerRole::PrefillDecode)
                && (has(WorkerRole::Prefill) || has(WorkerRole::Decode))
            {
                return Err(config_error(
                    "--selector (prefill_decode workers) cannot be mixed with \
                     --prefill-selector/--decode-selector",
                ));
            }
            if self.service_discovery_port == 0 {
                return Err(config_error(
                    "--service-discovery-port must be a port (1-65535)",
                ));
            }
            for (flag, annotation) in [
                (
                    "--bootstrap-port-annotation",
                    &self.bootstrap_port_annotation,
                ),
                (
                    "--kv-events-port-annotation",
                    &self.kv_events_port_annotation,
                ),
            ] {
                if annotation.trim().is_empty() {
                    return Err(config_error(&format!("{flag} must not be empty")));
                }
            }
            Some(KubernetesDiscovery {
                selectors,
                namespace: self
                    .service_discovery_namespace
                    .clone()
                    .filter(|n| !n.trim().is_empty()),
                port: self.service_discovery_port,
                bootstrap_port_annotation: self.bootstrap_port_annotation.clone(),
                kv_events_port_annotation: self.kv_events_port_annotation.clone(),
                kubeconfig: self.kubeconfig.clone(),
            })
        } else {
            if !selectors.is_empty() {
                return Err(config_error(
                    "pod selectors (--selector, --prefill-selector, ...) need --service-discovery",
                ));
            }
            None
        };
        Ok(DiscoveryConfig {
            file: self.discover_file.clone(),
            dns,
            dns_server: self.discover_dns_server,
            interval: self.discover_interval,
            kubernetes,
        })
    }
}

fn config_error(why: &str) -> GatewayError {
    GatewayError::Config(why.to_string())
}

/// Parses `ROLE=NAME:PORT` (`NAME` may be an IPv6 literal in brackets).
pub fn parse_dns_target(raw: &str) -> Result<DnsTarget, GatewayError> {
    let bad = |why: &str| {
        config_error(&format!(
            "--discover-dns `{raw}`: {why} (expected ROLE=NAME:PORT, e.g. decode=pdserve-decode:8100)"
        ))
    };
    let (role, target) = raw.trim().split_once('=').ok_or_else(|| bad("no `=`"))?;
    let role: WorkerRole = role.trim().parse().map_err(|e| bad(&format!("{e}")))?;
    let (name, port) = target.rsplit_once(':').ok_or_else(|| bad("no `:PORT`"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("the port must be a number from 1 to 65535"))?;
    let name = name.trim_start_matches('[').trim_end_matches(']');
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains('/') {
        return Err(bad("the name must be a host name or an address"));
    }
    Ok(DnsTarget {
        role,
        name: name.to_string(),
        port,
    })
}

/// Parses `key=value` labels; keys and values follow Kubernetes' label syntax loosely
/// (the API server has the last word).
fn parse_selector(flag: &str, labels: &[String]) -> Result<LabelSelector, GatewayError> {
    let mut pairs = Vec::new();
    for label in labels.iter().flat_map(|l| l.split_whitespace()) {
        let Some((key, value)) = label.split_once('=') else {
            return Err(config_error(&format!(
                "{flag} `{label}`: a label is `key=value`"
            )));
        };
        let valid = |s: &str, extra: &[char]| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c) || extra.contains(&c))
        };
        if key.is_empty() || !valid(key, &['/']) || !valid(value, &[]) {
            return Err(config_error(&format!(
                "{flag} `{label}`: keys and values are letters, digits, `-`, `_` and `.` \
                 (keys may have a `prefix/`)"
            )));
        }
        pairs.push((key.to_string(), value.to_string()));
    }
    Ok(LabelSelector(pairs))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DiscoveryArgs,
    }

    fn config(argv: &[&str]) -> Result<DiscoveryConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("gw").chain(argv.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.args.to_config().map_err(|e| e.to_string())
    }

    #[test]
    fn kubernetes_flags_read_as_sglang_and_vllm_router_write_them() {
        let c = config(&[
            "--service-discovery",
            "--prefill-selector",
            "app=sglang",
            "component=prefill",
            "--decode-selector",
            "app=sglang,component=decode",
            "--service-discovery-namespace",
            "serving",
            "--service-discovery-port",
            "30000",
        ])
        .unwrap();
        let k = c.kubernetes.unwrap();
        assert_eq!(k.selectors.len(), 2);
        assert_eq!(k.selectors[0].0, WorkerRole::Prefill);
        assert_eq!(k.selectors[0].1.to_query(), "app=sglang,component=prefill");
        assert_eq!(k.selectors[1].1.to_query(), "app=sglang,component=decode");
        assert_eq!(k.namespace.as_deref(), Some("serving"));
        assert_eq!(k.port, 30000);
        assert_eq!(
            k.bootstrap_port_annotation,
            DEFAULT_BOOTSTRAP_PORT_ANNOTATION
        );
        let both = config(&["--service-discovery", "--selector", "app=pdserve"]).unwrap();
        assert_eq!(
            both.kubernetes.unwrap().selectors[0].0,
            WorkerRole::PrefillDecode
        );
    }

    #[test]
    fn bad_discovery_flags_say_what_is_wrong() {
        for (argv, says) in [
            (&["--service-discovery"][..], "needs a pod selector"),
            (
                &["--prefill-selector", "app=x"][..],
                "need --service-discovery",
            ),
            (
                &[
                    "--service-discovery",
                    "--selector",
                    "a=b",
                    "--decode-selector",
                    "c=d",
                ][..],
                "cannot be mixed",
            ),
            (
                &["--service-discovery", "--selector", "app"][..],
                "key=value",
            ),
            (
                &["--service-discovery", "--selector", "a=b c"][..],
                "key=value",
            ),
            (
                &["--service-discovery", "--selector", "a=b!"][..],
                "letters",
            ),
            (&["--discover-dns", "decode=name"][..], "no `:PORT`"),
            (&["--discover-dns", "cook=name:1"][..], "cook"),
            (&["--discover-dns", "decode=name:0"][..], "port"),
            (&["--discover-dns", "name:80"][..], "no `=`"),
            (
                &["--discover-dns-server", "127.0.0.1:53"][..],
                "needs --discover-dns",
            ),
            (&["--discover-interval", "0"][..], "positive"),
        ] {
            let err = config(argv).unwrap_err();
            assert!(err.contains(says), "{argv:?}: {err}");
        }
    }

    #[test]
    fn dns_targets_name_a_role_a_host_and_a_port() {
        let c = config(&[
            "--discover-dns",
            "prefill=pdserve-prefill.default.svc:8100",
            "--discover-dns",
            "decode=[::1]:8200,both=10.0.0.1:80",
        ])
        .unwrap();
        assert_eq!(
            c.dns,
            vec![
                DnsTarget {
                    role: WorkerRole::Prefill,
                    name: "pdserve-prefill.default.svc".into(),
                    port: 8100
                },
                DnsTarget {
                    role: WorkerRole::Decode,
                    name: "::1".into(),
                    port: 8200
                },
                DnsTarget {
                    role: WorkerRole::PrefillDecode,
                    name: "10.0.0.1".into(),
                    port: 80
                },
            ]
        );
        assert!(c.any());
        assert!(!config(&[]).unwrap().any());
    }
}
