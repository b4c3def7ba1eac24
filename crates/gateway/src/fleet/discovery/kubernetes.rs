//! `--service-discovery`: workers are the pods that match a role's label selector,
//! watched through the Kubernetes API (one watch per selector, filtered by the API
//! server). A pod is routed to only while it is Running, Ready and not terminating.
//!
//! Pods are kept by UID: an event replaces the pod's record whole, so a new IP or a lost
//! label (the API server sends that as a deletion from the selector's watch) changes the
//! URL or removes the worker, and a deleted pod's worker goes (requests already on it
//! finish). When a watch breaks or expires (410 Gone), the watcher lists the pods again and
//! the list replaces what that selector had: a pod that went away while nobody watched
//! does not survive it, and a pod listed again keeps its health and breaker.
//!
//! A pod's URL is `http://POD_IP:--service-discovery-port`, or the port its
//! `pdserve.dev/port` annotation gives (hostNetwork pods on one node share an IP).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use pdserve_protocol::WorkerRole;
use reqwest::Url;

use super::Discoverer;
use super::{
    KubernetesDiscovery, DP_SIZE_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION, PORT_ANNOTATION,
};
use crate::fleet::registry::check_dp_size;
use crate::fleet::registry::{WorkerSource, WorkerSpec};

/// Whether a pod receives traffic, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodWorker {
    /// It serves at this spec.
    Routable(WorkerSpec),
    /// It does not serve now, and why (for the log).
    NotRoutable(String),
}

/// The pods one selector's watch has seen, by UID.
#[derive(Debug, Default)]
struct SelectorPods {
    pods: BTreeMap<String, (String, PodWorker)>,
    /// Pods of a re-list in progress; they replace `pods` when it completes.
    relisting: Option<BTreeMap<String, (String, PodWorker)>>,
}

/// What every selector's watch has seen: the state the registry's Kubernetes workers
/// are made from.
#[derive(Debug)]
pub struct PodRoster {
    config: KubernetesDiscovery,
    seen: Vec<SelectorPods>,
}

impl PodRoster {
    /// Nothing seen yet.
    pub fn new(config: KubernetesDiscovery) -> Self {
        let seen = config
            .selectors
            .iter()
            .map(|_| SelectorPods::default())
            .collect();
        Self { config, seen }
    }

    /// Takes one event of selector `i`'s watch; returns whether the pods it knows
    /// changed (a re-list in progress changes nothing until it completes).
    pub fn on_event(&mut self, i: usize, event: Event<Pod>) -> bool {
        let role = self.config.selectors[i].0;
        let config = &self.config;
        let pods = &mut self.seen[i];
        match event {
            Event::Init => {
                pods.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                if let Some((uid, record)) = record(&pod, role, config) {
                    pods.relisting
                        .get_or_insert_with(BTreeMap::new)
                        .insert(uid, record);
                }
                false
            }
            Event::InitDone => {
                pods.pods = pods.relisting.take().unwrap_or_default();
                true
            }
            Event::Apply(pod) => match record(&pod, role, config) {
                Some((uid, record)) => {
                    note_change(pods.pods.get(&uid), &record, role);
                    pods.pods.insert(uid, record);
                    true
                }
                None => false,
            },
            Event::Delete(pod) => match pod.metadata.uid.as_deref() {
                Some(uid) => pods.pods.remove(uid).is_some(),
                None => false,
            },
        }
    }

    /// The routable workers of every selector, one per URL, sorted by URL.
    pub fn workers(&self) -> Vec<WorkerSpec> {
        let mut by_url: BTreeMap<String, WorkerSpec> = BTreeMap::new();
        for pods in &self.seen {
            for (_, worker) in pods.pods.values() {
                if let PodWorker::Routable(spec) = worker {
                    by_url.entry(spec.key()).or_insert_with(|| spec.clone());
                }
            }
        }
        by_url.into_values().collect()
    }
}

/// Watches every selector's pods until aborted, keeping the registry's Kubernetes
/// workers equal to the routable pods.
pub async fn watch(state: Arc<Discoverer>, config: KubernetesDiscovery) {
    let client = loop {
        match client(&config).await {
            Ok(client) => break client,
            Err(why) => {
                super::failed(&state, WorkerSource::Kubernetes, &why);
                tokio::time::sleep(state.interval).await;
            }
        }
    };
    let api: Api<Pod> = match &config.namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    };
    tracing::info!(
        namespace = config.namespace.as_deref().unwrap_or("(all)"),
        selectors = ?config
            .selectors
            .iter()
            .map(|(role, s)| format!("{role}: {}", s.to_query()))
            .collect::<Vec<_>>(),
        "watching Kubernetes pods for workers"
    );
    let watches = config
        .selectors
        .iter()
        .enumerate()
        .map(|(i, (_, selector))| {
            let settings = watcher::Config::default().labels(&selector.to_query());
            watcher::watcher(api.clone(), settings)
                .default_backoff()
                .map(move |event| (i, event))
                .boxed()
        });
    let mut events = futures::stream::select_all(watches);
    let mut roster = PodRoster::new(config);
    let mut applied: Option<Vec<WorkerSpec>> = None;
    while let Some((i, event)) = events.next().await {
        match event {
            Ok(event) => {
                if !roster.on_event(i, event) {
                    continue;
                }
            }
            Err(e) => {
                super::failed(
                    &state,
                    WorkerSource::Kubernetes,
                    &format!("the pod watch failed, retrying with backoff: {e}"),
                );
                continue;
            }
        }
        let specs = roster.workers();
        if applied.as_ref() != Some(&specs) {
            super::apply(&state, WorkerSource::Kubernetes, specs.clone()).await;
            applied = Some(specs);
        }
    }
}

/// A pod's UID and its record (its name and what it is to routing); `None` for a pod
/// without a UID, which the API server never sends.
fn record(
    pod: &Pod,
    role: WorkerRole,
    config: &KubernetesDiscovery,
) -> Option<(String, (String, PodWorker))> {
    let uid = pod.metadata.uid.clone()?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    Some((uid, (name, pod_worker(pod, role, config))))
}

/// Logs a pod going in or out of service (the roster change is logged by `apply`).
fn note_change(
    before: Option<&(String, PodWorker)>,
    after: &(String, PodWorker),
    role: WorkerRole,
) {
    let (name, now) = after;
    if let (Some(PodWorker::Routable(_)) | None, PodWorker::NotRoutable(why)) =
        (before.map(|(_, w)| w), now)
    {
        tracing::info!(pod = %name, %role, "pod not routable: {why}");
    }
}

/// What `pod` is to routing as a worker of `role`.
pub fn pod_worker(pod: &Pod, role: WorkerRole, config: &KubernetesDiscovery) -> PodWorker {
    let not = |why: String| PodWorker::NotRoutable(why);
    if pod.metadata.deletion_timestamp.is_some() {
        return not("terminating".into());
    }
    let Some(status) = &pod.status else {
        return not("no status yet".into());
    };
    let phase = status.phase.as_deref().unwrap_or("Unknown");
    if phase != "Running" {
        return not(format!("phase {phase}"));
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return not("not Ready".into());
    }
    let Some(ip) = status.pod_ip.as_deref().filter(|ip| !ip.is_empty()) else {
        return not("no pod IP".into());
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return not(format!("pod IP `{ip}` is not an address"));
    };
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
    let port_in = |key: &str| -> Result<Option<u16>, String> {
        annotation(key)
            .map(|v| {
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("annotation {key}={v:?} is not a port (1-65535)"))
            })
            .transpose()
    };
    // hostNetwork pods share their node's IP: each names its own port.
    let port = match port_in(PORT_ANNOTATION) {
        Ok(port) => port.unwrap_or(config.port),
        Err(why) => return not(why),
    };
    let url = Url::parse(&format!("http://{}", std::net::SocketAddr::new(ip, port)))
        .expect("an address and a port make a URL");
    let mut spec = WorkerSpec::new(role, url);
    if role == WorkerRole::Prefill {
        match port_in(&config.bootstrap_port_annotation) {
            Ok(port) => spec.bootstrap_port = port,
            Err(why) => return not(why),
        }
    }
    for (annotation, endpoint) in [
        (
            config.kv_events_port_annotation.as_str(),
            &mut spec.kv_events_endpoint,
        ),
        (
            KV_EVENTS_REPLAY_PORT_ANNOTATION,
            &mut spec.kv_events_replay_endpoint,
        ),
    ] {
        match port_in(annotation) {
            Ok(port) => {
                *endpoint = port.map(|p| format!("tcp://{}", std::net::SocketAddr::new(ip, p)));
            }
            Err(why) => return not(why),
        }
    }
    if let Some(v) = annotation(DP_SIZE_ANNOTATION) {
        match v
            .trim()
            .parse::<u64>()
            .map_err(|e| e.to_string())
            .and_then(check_dp_size)
        {
            Ok(n) => spec.dp_size = n,
            Err(why) => return not(format!("annotation {DP_SIZE_ANNOTATION}={v:?}: {why}")),
        }
    }
    PodWorker::Routable(spec)
}

/// A client from `--kubeconfig`, else the in-cluster service account, $KUBECONFIG or
/// ~/.kube/config (kube's inference order).
async fn client(config: &KubernetesDiscovery) -> Result<Client, String> {
    let settings = match &config.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read --kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            format!("no Kubernetes configuration (in-cluster, $KUBECONFIG or ~/.kube/config): {e}")
        })?,
    };
    Client::try_from(settings).map_err(|e| format!("cannot make a Kubernetes client: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::discovery::{
        LabelSelector, DEFAULT_BOOTSTRAP_PORT_ANNOTATION, DEFAULT_KV_EVENTS_PORT_ANNOTATION,
    };

    fn config() -> KubernetesDiscovery {
        KubernetesDiscovery {
            selectors: vec![(
                WorkerRole::Prefill,
                LabelSelector(vec![("app".into(), "p".into())]),
            )],
            namespace: None,
            port: 8100,
            bootstrap_port_annotation: DEFAULT_BOOTSTRAP_PORT_ANNOTATION.into(),
            kv_events_port_annotation: DEFAULT_KV_EVENTS_PORT_ANNOTATION.into(),
            kubeconfig: None,
        }
    }

    fn pod(patch: serde_json::Value) -> Pod {
        let mut base = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p-0", "uid": "u-0", "namespace": "default",
                         "labels": {"app": "p"}},
            "status": {"phase": "Running", "podIP": "10.1.2.3",
                       "conditions": [{"type": "Ready", "status": "True"}]}
        });
        merge(&mut base, patch);
        serde_json::from_value(base).unwrap()
    }

    fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
        match (base, patch) {
            (serde_json::Value::Object(b), serde_json::Value::Object(p)) => {
                for (k, v) in p {
                    merge(b.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (b, p) => *b = p,
        }
    }

    fn urls(roster: &PodRoster) -> Vec<String> {
        roster.workers().iter().map(WorkerSpec::key).collect()
    }

    #[test]
    fn the_roster_follows_pods_by_uid_and_a_relist_replaces_what_it_knew() {
        let mut roster = PodRoster::new(config());
        let a = pod(serde_json::json!({}));
        let b = pod(
            serde_json::json!({"metadata": {"name": "p-1", "uid": "u-1"},
                                        "status": {"podIP": "10.1.2.4"}}),
        );
        assert!(!roster.on_event(0, Event::Init));
        assert!(!roster.on_event(0, Event::InitApply(a.clone())));
        assert!(
            roster.workers().is_empty(),
            "nothing before the list completes"
        );
        assert!(roster.on_event(0, Event::InitDone));
        assert_eq!(urls(&roster), ["http://10.1.2.3:8100"]);
        roster.on_event(0, Event::Apply(b.clone()));
        assert_eq!(
            urls(&roster),
            ["http://10.1.2.3:8100", "http://10.1.2.4:8100"]
        );
        // A new IP replaces the pod's URL; NotReady takes it out; Ready brings it back.
        let moved = pod(serde_json::json!({"status": {"podIP": "10.1.9.9"}}));
        roster.on_event(0, Event::Apply(moved));
        assert_eq!(
            urls(&roster),
            ["http://10.1.2.4:8100", "http://10.1.9.9:8100"]
        );
        let not_ready = pod(serde_json::json!({"status": {"podIP": "10.1.9.9",
            "conditions": [{"type": "Ready", "status": "False"}]}}));
        roster.on_event(0, Event::Apply(not_ready));
        assert_eq!(urls(&roster), ["http://10.1.2.4:8100"]);
        // Deleted (or no longer matching the selector): gone.
        assert!(roster.on_event(0, Event::Delete(b)));
        assert!(roster.workers().is_empty());
        // A re-list that finds only `a` again drops whatever it does not list.
        roster.on_event(0, Event::Apply(pod(serde_json::json!({"metadata": {"uid": "u-2", "name": "p-2"}, "status": {"podIP": "10.1.2.5"}}))));
        roster.on_event(0, Event::Init);
        roster.on_event(0, Event::InitApply(a));
        assert_eq!(
            urls(&roster),
            ["http://10.1.2.5:8100"],
            "the old view stands while listing"
        );
        roster.on_event(0, Event::InitDone);
        assert_eq!(urls(&roster), ["http://10.1.2.3:8100"]);
    }

    #[test]
    fn only_running_ready_live_pods_route_and_annotations_fill_the_spec() {
        let c = config();
        let PodWorker::Routable(spec) = pod_worker(
            &pod(serde_json::json!({"metadata": {"annotations": {
                "sglang.ai/bootstrap-port": "8998",
                "pdserve.dev/dp-size": "2",
                "pdserve.dev/kv-events-port": "5557",
                "pdserve.dev/kv-events-replay-port": "5558"}}})),
            WorkerRole::Prefill,
            &c,
        ) else {
            panic!("a ready pod routes");
        };
        assert_eq!(spec.key(), "http://10.1.2.3:8100");
        assert_eq!(spec.bootstrap_port, Some(8998));
        assert_eq!(spec.dp_size, 2);
        assert_eq!(
            spec.kv_events_endpoint.as_deref(),
            Some("tcp://10.1.2.3:5557")
        );
        assert_eq!(
            spec.kv_events_replay_endpoint.as_deref(),
            Some("tcp://10.1.2.3:5558")
        );
        let host_network =
            pod(serde_json::json!({"metadata": {"annotations": {"pdserve.dev/port": "9100"}}}));
        assert!(matches!(
            pod_worker(&host_network, WorkerRole::Decode, &c),
            PodWorker::Routable(s) if s.key() == "http://10.1.2.3:9100"
        ));
        let v6 = pod(serde_json::json!({"status": {"podIP": "fd00::5"}}));
        assert!(matches!(
            pod_worker(&v6, WorkerRole::Decode, &c),
            PodWorker::Routable(s) if s.key() == "http://[fd00::5]:8100" && s.bootstrap_port.is_none()
        ));
        for (patch, why) in [
            (
                serde_json::json!({"metadata": {"deletionTimestamp": "2026-12-02T10:00:00Z"}}),
                "terminating",
            ),
            (
                serde_json::json!({"status": {"phase": "Pending"}}),
                "Pending",
            ),
            (
                serde_json::json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
                "not Ready",
            ),
            (
                serde_json::json!({"status": {"conditions": []}}),
                "not Ready",
            ),
            (serde_json::json!({"status": {"podIP": null}}), "no pod IP"),
            (
                serde_json::json!({"metadata": {"annotations": {"sglang.ai/bootstrap-port": "x"}}}),
                "bootstrap-port",
            ),
            (
                serde_json::json!({"metadata": {"annotations": {"pdserve.dev/dp-size": "0"}}}),
                "dp-size",
            ),
            (
                serde_json::json!({"metadata": {"annotations": {"pdserve.dev/port": "70000"}}}),
                "pdserve.dev/port",
            ),
        ] {
            match pod_worker(&pod(patch.clone()), WorkerRole::Prefill, &c) {
                PodWorker::NotRoutable(reason) => {
                    assert!(reason.contains(why), "{patch}: {reason}")
                }
                routable => panic!("{patch}: {routable:?}"),
            }
        }
    }
}
