//! The deployment files agree with the binary: the Kubernetes manifest's containers use
//! the image the Dockerfile builds, flags `pdserve` accepts, the ports those flags open,
//! probe paths the gateway and workers serve, and Services that reach those ports.

use std::collections::BTreeSet;

use clap::Parser;
use pdserve_engine::WorkerArgs;
use pdserve_gateway::GatewayArgs;
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
}

/// Parses a container's args with the binary's own flag definitions.
fn parse(args: &[String]) -> Served {
    // Kubernetes expands $(POD_IP) from the environment; any address parses the same.
    let args: Vec<String> = args
        .iter()
        .map(|a| a.replace("$(POD_IP)", "127.0.0.1"))
        .collect();
    let (command, flags) = args.split_first().expect("a subcommand");
    let argv = std::iter::once(command.clone()).chain(flags.iter().cloned());
    match command.as_str() {
        "gateway" => {
            let cli = GatewayCli::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}"));
            cli.args.to_config().unwrap_or_else(|e| panic!("{e}"));
            Served {
                ports: [cli.args.port].into(),
                http_port: cli.args.port,
                readiness: "/readiness",
                liveness: "/liveness",
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
            if args[0] == "gateway" {
                // Each worker URL names a Service and the port it exposes.
                for flag in ["--prefill", "--decode"] {
                    let i = args.iter().position(|a| a == flag).unwrap();
                    let url = reqwest::Url::parse(&args[i + 1]).unwrap();
                    let svc = services
                        .iter()
                        .find(|s| s["metadata"]["name"] == url.host_str().unwrap())
                        .unwrap_or_else(|| panic!("no Service for {url}"));
                    let ports: Vec<u16> = svc["spec"]["ports"]
                        .as_sequence()
                        .unwrap()
                        .iter()
                        .map(|p| port(&p["port"]))
                        .collect();
                    assert!(ports.contains(&url.port().unwrap()), "{url}");
                }
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
            opened.push((labels, served.ports));
        }
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
