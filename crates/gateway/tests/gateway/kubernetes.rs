//! Kubernetes discovery against the stand-in API server: the roster after each pod event
//! (Ready, NotReady, relabelled, re-addressed, terminating, deleted), a watch cut
//! mid-stream, a watch that expires (410 Gone) across a deletion nobody saw, and a decode
//! pod replaced under load without a failed request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_gateway::fleet::discovery::{KubernetesDiscovery, LabelSelector};
use pdserve_gateway::GatewayConfig;
use pdserve_protocol::WorkerRole;
use serde_json::{json, Value};

use crate::double::{Double, Role};
use crate::kube_api::{pod, KubeApi};
use crate::{bounded, client, metric, Gateway, RosterRow};

const NAMESPACE: &str = "serving";

fn selector(role: &str) -> LabelSelector {
    LabelSelector(vec![
        ("app".into(), "pdserve".into()),
        ("role".into(), role.into()),
    ])
}

fn labels(role: &str) -> Value {
    json!({"app": "pdserve", "role": role, "pod-template-hash": "abc"})
}

fn port_of(double: &Double) -> u16 {
    double.url.rsplit(':').next().unwrap().parse().unwrap()
}

fn discovering(api: &KubeApi, name: &str) -> GatewayConfig {
    let mut config = GatewayConfig::new(Vec::new(), Vec::new(), Vec::new());
    config.discovery.kubernetes = Some(KubernetesDiscovery {
        selectors: vec![
            (WorkerRole::Prefill, selector("prefill")),
            (WorkerRole::Decode, selector("decode")),
        ],
        namespace: Some(NAMESPACE.into()),
        port: 8000,
        bootstrap_port_annotation: "sglang.ai/bootstrap-port".into(),
        kv_events_port_annotation: "pdserve.dev/kv-events-port".into(),
        kubeconfig: Some(api.kubeconfig(name)),
    });
    config
}

fn row(double: &Double, role: &str) -> RosterRow {
    (double.url.clone(), role.into(), "kubernetes".into())
}

async fn roster_becomes(gw: &Gateway, expected: &[RosterRow], since: Instant) -> Duration {
    gw.roster_becomes(expected, since).await
}

fn set_ready(pod: &mut Value, ready: bool) {
    pod["status"]["conditions"] =
        json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
}

#[tokio::test]
async fn the_roster_follows_pod_events_watch_cuts_and_expiry() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d0 = Double::start(Role::Decode, "D0").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let api = KubeApi::start(NAMESPACE).await;
        api.put(pod("p-0", "uid-p0", labels("prefill"), port_of(&p), true));
        api.put(pod("d-0", "uid-d0", labels("decode"), port_of(&d0), true));
        api.put(pod("d-1", "uid-d1", labels("decode"), port_of(&d1), false));
        // Another app's pod in the namespace is never a worker.
        api.put(pod(
            "other",
            "uid-o",
            json!({"app": "web"}),
            port_of(&d1),
            true,
        ));
        let started = Instant::now();
        let gw = Gateway::start(discovering(&api, "events")).await;

        let mut timings = Vec::new();
        let first = [row(&p, "prefill"), row(&d0, "decode")];
        timings.push((
            "list to routable",
            roster_becomes(&gw, &first, started).await,
        ));
        assert_eq!(gw.chat_status().await, 200);
        // Each role's watch asks for its own selector.
        let log = api.log();
        for role in ["prefill", "decode"] {
            assert!(
                log.iter().any(|l| l.starts_with("list")
                    && l.contains(&format!("labelSelector=app=pdserve,role={role}"))),
                "{log:?}"
            );
        }

        let both = [row(&p, "prefill"), row(&d0, "decode"), row(&d1, "decode")];
        let at = api.update("d-1", |pod| set_ready(pod, true));
        timings.push(("Ready to routable", roster_becomes(&gw, &both, at).await));

        let at = api.update("d-0", |pod| set_ready(pod, false));
        let without_d0 = [row(&p, "prefill"), row(&d1, "decode")];
        timings.push((
            "NotReady to removed",
            roster_becomes(&gw, &without_d0, at).await,
        ));
        let at = api.update("d-0", |pod| set_ready(pod, true));
        roster_becomes(&gw, &both, at).await;

        // Relabelled out of the selector (a DELETED on that watch), then back.
        let at = api.update("d-0", |pod| {
            pod["metadata"]["labels"]["role"] = json!("canary")
        });
        roster_becomes(&gw, &without_d0, at).await;
        let at = api.update("d-0", |pod| {
            pod["metadata"]["labels"]["role"] = json!("decode")
        });
        roster_becomes(&gw, &both, at).await;

        // The same pod (UID) at a new address replaces its worker: d-1 moves to D0's
        // port, so the roster holds D0 once, and D1's URL is gone.
        let at = api.update("d-1", |pod| {
            pod["metadata"]["annotations"]["pdserve.dev/port"] = json!(port_of(&d0).to_string())
        });
        roster_becomes(&gw, &first, at).await;
        let at = api.update("d-1", |pod| {
            pod["metadata"]["annotations"]["pdserve.dev/port"] = json!(port_of(&d1).to_string())
        });
        roster_becomes(&gw, &both, at).await;

        // A watch cut mid-stream resumes from its last resourceVersion: a change made
        // while no watch was open still arrives.
        let watches = api.log().iter().filter(|l| l.starts_with("watch")).count();
        api.cut_watches();
        let at = api.update("d-1", |pod| set_ready(pod, false));
        roster_becomes(&gw, &first, at).await;
        assert!(api.log().iter().filter(|l| l.starts_with("watch")).count() > watches);
        let at = api.update("d-1", |pod| set_ready(pod, true));
        roster_becomes(&gw, &both, at).await;

        // History compacted past a deletion: the resumed watch gets 410 Gone, the
        // watcher lists again, and the pod nobody saw deleted is gone from the roster.
        let errors = metric(
            &gw,
            r#"pdserve_gateway_discovery_errors_total{source="kubernetes"}"#,
        )
        .await;
        let lists = api.log().iter().filter(|l| l.starts_with("list")).count();
        api.delete_unseen("d-0");
        let at = Instant::now();
        api.cut_watches();
        roster_becomes(&gw, &without_d0, at).await;
        assert!(api.log().iter().filter(|l| l.starts_with("list")).count() > lists);
        assert!(
            metric(
                &gw,
                r#"pdserve_gateway_discovery_errors_total{source="kubernetes"}"#
            )
            .await
                > errors,
            "the expired watch is counted"
        );

        // Terminating (deletionTimestamp) leaves routing at once; the deletion follows.
        let at = api.update("d-1", |pod| {
            pod["metadata"]["deletionTimestamp"] = json!("2026-12-02T10:05:00Z")
        });
        let prefill_only = [row(&p, "prefill")];
        timings.push((
            "terminating to removed",
            roster_becomes(&gw, &prefill_only, at).await,
        ));
        api.delete("d-1");
        let at = api.put(pod("d-2", "uid-d2", labels("decode"), port_of(&d1), true));
        roster_becomes(&gw, &[row(&p, "prefill"), row(&d1, "decode")], at).await;
        let at = api.delete("d-2");
        timings.push((
            "deleted to removed",
            roster_becomes(&gw, &prefill_only, at).await,
        ));
        for (what, took) in &timings {
            eprintln!(
                "kubernetes discovery: {what}: {:.1} ms",
                took.as_secs_f64() * 1e3
            );
        }
    })
    .await;
}

/// A decode pod replaced the way a rolling update does it (new pod Ready, old pod
/// terminating, then deleted) while requests keep coming: none fails.
#[tokio::test]
async fn a_decode_pod_replaced_under_load_loses_no_request() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let old = Double::start(Role::Decode, "old").await;
        let new = Double::start(Role::Decode, "new").await;
        let api = KubeApi::start(NAMESPACE).await;
        api.put(pod("p-0", "uid-p0", labels("prefill"), port_of(&p), true));
        api.put(pod("d-old", "uid-old", labels("decode"), port_of(&old), true));
        let gw = Gateway::start(discovering(&api, "rollout")).await;
        roster_becomes(&gw, &[row(&p, "prefill"), row(&old, "decode")], Instant::now()).await;

        let stop = Arc::new(AtomicBool::new(false));
        let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let load: Vec<_> = (0..4)
            .map(|_| {
                let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
                let url = gw.at("/v1/chat/completions");
                tokio::spawn(async move {
                    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
                    let http = client();
                    while !stop.load(Ordering::Relaxed) {
                        let ok = matches!(
                            http.post(&url).json(&body).send().await,
                            Ok(r) if r.status() == 200
                        );
                        sent.fetch_add(1, Ordering::Relaxed);
                        if !ok {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let at = api.put(pod("d-new", "uid-new", labels("decode"), port_of(&new), true));
        roster_becomes(
            &gw,
            &[row(&p, "prefill"), row(&old, "decode"), row(&new, "decode")],
            at,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let at = api.update("d-old", |pod| {
            pod["metadata"]["deletionTimestamp"] = json!("2026-12-02T10:05:00Z")
        });
        let took = roster_becomes(&gw, &[row(&p, "prefill"), row(&new, "decode")], at).await;
        // The old worker keeps serving what it has until its pod is gone.
        tokio::time::sleep(Duration::from_millis(100)).await;
        api.delete("d-old");
        let served_by_old = old.requests().len();
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, Ordering::Relaxed);
        for task in load {
            task.await.unwrap();
        }
        let (sent, failed) = (sent.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
        eprintln!(
            "kubernetes discovery under load: {sent} requests, {failed} failed; terminating to removed {:.1} ms",
            took.as_secs_f64() * 1e3
        );
        assert_eq!(failed, 0, "{failed} of {sent} requests failed");
        assert!(served_by_old > 0 && !new.requests().is_empty());
        assert_eq!(old.requests().len(), served_by_old, "nothing reaches a removed pod");
    })
    .await;
}
