//! The deployment files agree with the binary: the Kubernetes manifest's containers use
//! the image the Dockerfile builds, flags `pdserve` accepts, the ports those flags open,
//! probe paths the gateway and workers serve, and Services that reach those ports.

use std::collections::BTreeSet;

use clap::Parser;
use pdserve_engine::WorkerArgs;
use pdserve_gateway::fleet::discovery::KubernetesDiscovery;
use pdserve_gateway::GatewayArgs;
use pdserve_protocol::WorkerRole;
use serde_yaml_ng::Value;

const MANIFEST: &str = include_str!("../../../deploy/kubernetes/pdserve.yaml");
const DOCKERFILE: &str = include_str!("../../../Dockerfile");
const README: &str = include_str!("../../../README.md");
const IMAGE: &str = "pdserve:latest";

#[derive(Parser)]
struct GatewayCli {
    #[command(flatten)]
    args: GatewayArgs,
}

#[derive(Parser)]
struct WorkerCli {
    #[command(flatten)]
    args: WorkerArgs,
}

fn documents() -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(MANIFEST)
        .map(|d| serde_yaml_ng::with::singleton_map_recursive::deserialize(d).unwrap())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn port(v: &Value) -> u16 {
    v.as_u64().expect("a numeric port") as u16
}

/// What a container's args open and which probe paths it needs.
struct Served {
    ports: BTreeSet<u16>,
    http_port: u16,
    readiness: &'static str,
    liveness: &'static str,
    /// A worker's role.
    role: Option<WorkerRole>,
    /// A gateway's pod discovery.
    kubernetes: Option<KubernetesDiscovery>,
}

/// Parses a container's args with the binary's own flag definitions.
fn parse(args: &[String]) -> Served {
    // Kubernetes expands $(POD_IP) and $(POD_NAMESPACE) from the environment; any
    // address and name parse the same.
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.replace("$(POD_IP)", "127.0.0.1")
                .replace("$(POD_NAMESPACE)", "default")
        })
        .collect();
    let (command, flags) = args.split_first().expect("a subcommand");
    let argv = std::iter::once(command.clone()).chain(flags.iter().cloned());
    match command.as_str() {
        "gateway" => {
            let cli = GatewayCli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}"));
            let config = cli.args.to_config().unwrap_or_else(|e| panic!("{e}"));
            Served {
                ports: [cli.args.port].into(),
                http_port: cli.args.port,
                readiness: "/readiness",
                liveness: "/liveness",
                role: None,
                kubernetes: config.discovery.kubernetes,
            }
        }
        "worker" => {
            let cli = WorkerCli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}"));
            let mut ports: BTreeSet<u16> = [cli.args.port].into();
            ports.extend(cli.args.kv_port);
            Served {
                ports,
                http_port: cli.args.port,
                readiness: "/health",
                liveness: "/health",
                role: Some(cli.args.role),
                kubernetes: None,
            }
        }
        other => panic!("unexpected subcommand {other}"),
    }
}

#[test]
fn manifest_matches_the_binary_and_the_dockerfile() {
    let docs = documents();
    let deployments = of_kind(&docs, "Deployment");
    let services = of_kind(&docs, "Service");
    assert_eq!(deployments.len(), 3, "prefill, decode and gateway");
    let mut opened: Vec<(Value, BTreeSet<u16>)> = Vec::new();
    let mut workers: Vec<(Value, WorkerRole, u16)> = Vec::new();
    let mut discovering: Vec<(&Value, KubernetesDiscovery, Value)> = Vec::new();
    for d in &deployments {
        let name = d["metadata"]["name"].as_str().unwrap();
        let containers = d["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .unwrap();
        for c in containers {
            assert_eq!(c["image"], IMAGE, "{name}");
            let args: Vec<String> = c["args"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect();
            let served = parse(&args);
            let declared: BTreeSet<u16> = c["ports"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|p| port(&p["containerPort"]))
                .collect();
            assert_eq!(declared, served.ports, "{name}: containerPorts vs flags");
            for (probe, path) in [
                ("readinessProbe", served.readiness),
                ("livenessProbe", served.liveness),
            ] {
                let get = &c[probe]["httpGet"];
                assert_eq!(get["path"], path, "{name} {probe}");
                assert_eq!(port(&get["port"]), served.http_port, "{name} {probe}");
            }
            // The drain fits in the pod's grace period.
            let grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap();
            let drain = args
                .iter()
                .position(|a| a == "--shutdown-timeout")
                .map(|i| args[i + 1].parse::<u64>().unwrap())
                .unwrap_or(30);
            assert!(grace > drain, "{name}: grace {grace} s <= drain {drain} s");
            if let Some(kubernetes) = &served.kubernetes {
                discovering.push((d, kubernetes.clone(), c["env"].clone()));
            }
            // Every KV party carries the shared transfer secret from the manifest's Secret.
            let secret_ref = c["env"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == "PDSERVE_KV_SECRET")
                .map(|e| &e["valueFrom"]["secretKeyRef"])
                .unwrap_or_else(|| panic!("{name}: no PDSERVE_KV_SECRET"));
            assert!(
                of_kind(&docs, "Secret").iter().any(|s| {
                    s["metadata"]["name"] == secret_ref["name"]
                        && !s["stringData"][secret_ref["key"].as_str().unwrap()].is_null()
                }),
                "{name}: {secret_ref:?} names no Secret key in the manifest"
            );
            if args[0] == "worker" {
                // Workers trust exactly the worker Services, which must be headless so
                // their names resolve to the pod IPs that KV connections come from.
                let i = args.iter().position(|a| a == "--kv-peers").unwrap();
                for peer in args[i + 1].split(',') {
                    let svc = services
                        .iter()
                        .find(|s| s["metadata"]["name"] == peer)
                        .unwrap_or_else(|| panic!("{name}: --kv-peers {peer} is no Service"));
                    assert_eq!(svc["spec"]["clusterIP"], "None", "{peer} must be headless");
                }
            }
            let labels = d["spec"]["template"]["metadata"]["labels"].clone();
            if let Some(role) = served.role {
                workers.push((labels.clone(), role, served.http_port));
            }
            opened.push((labels, served.ports));
        }
    }
    // The gateway discovers every worker Deployment's pods, by role, at the port they
    // serve, with a service account that may read pods and do nothing else.
    assert_eq!(discovering.len(), 1, "the gateway uses --service-discovery");
    for (gateway, kubernetes, env) in &discovering {
        for (labels, role, http_port) in &workers {
            let selected: Vec<WorkerRole> = kubernetes
                .selectors
                .iter()
                .filter(|(_, s)| s.0.iter().all(|(k, v)| labels[k.as_str()] == v.as_str()))
                .map(|(r, _)| *r)
                .collect();
            assert_eq!(selected, [*role], "{labels:?} is selected as {selected:?}");
            assert_eq!(kubernetes.port, *http_port, "--service-discovery-port");
        }
        // The namespace comes from the downward API.
        let namespace_env = env
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == "POD_NAMESPACE")
            .expect("POD_NAMESPACE in the gateway's env");
        assert_eq!(
            namespace_env["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.namespace"
        );
        assert!(kubernetes.namespace.is_some(), "a Role needs a namespace");
        let account = gateway["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .expect("the gateway runs as its own service account");
        assert!(of_kind(&docs, "ServiceAccount")
            .iter()
            .any(|a| a["metadata"]["name"] == account));
        let binding = of_kind(&docs, "RoleBinding")
            .into_iter()
            .find(|b| {
                b["subjects"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|s| s["kind"] == "ServiceAccount" && s["name"] == account)
            })
            .expect("a RoleBinding for the gateway's account");
        assert_eq!(binding["roleRef"]["kind"], "Role");
        let role = of_kind(&docs, "Role")
            .into_iter()
            .find(|r| r["metadata"]["name"] == binding["roleRef"]["name"])
            .expect("the bound Role");
        let rules = role["rules"].as_sequence().unwrap();
        assert_eq!(rules.len(), 1, "pods only");
        let strings = |v: &Value| -> Vec<String> {
            v.as_sequence()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(strings(&rules[0]["apiGroups"]), [""]);
        assert_eq!(strings(&rules[0]["resources"]), ["pods"]);
        assert_eq!(strings(&rules[0]["verbs"]), ["get", "list", "watch"]);
    }
    // Every Service selects a pod and targets a port that pod opens.
    for s in &services {
        let selector = s["spec"]["selector"].as_mapping().unwrap();
        let (_, ports) = opened
            .iter()
            .find(|(labels, _)| {
                selector
                    .iter()
                    .all(|(k, v)| &labels[k.as_str().unwrap()] == v)
            })
            .unwrap_or_else(|| panic!("{:?} selects no pod", s["metadata"]["name"]));
        for p in s["spec"]["ports"].as_sequence().unwrap() {
            assert!(
                ports.contains(&port(&p["targetPort"])),
                "{:?}",
                s["metadata"]
            );
        }
    }
    // The Dockerfile builds with the README's command, tags the manifest's image and
    // exposes every port the manifest opens.
    assert!(README.contains("cargo build --release -p pdserve"));
    assert!(DOCKERFILE.contains("RUN cargo build --release -p pdserve"));
    assert!(DOCKERFILE.contains(&format!("-t {IMAGE}")));
    let exposed: BTreeSet<u16> = DOCKERFILE
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u16>().unwrap()))
        .collect();
    for (_, ports) in &opened {
        assert!(
            ports.is_subset(&exposed),
            "{ports:?} not all in EXPOSE {exposed:?}"
        );
    }
}
