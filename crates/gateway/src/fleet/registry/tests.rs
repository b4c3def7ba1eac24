use super::*;
use reqwest::Url;

fn spec(role: WorkerRole, port: u16) -> WorkerSpec {
    WorkerSpec::new(
        role,
        Url::parse(&format!("http://127.0.0.1:{port}")).unwrap(),
    )
}

fn registry(fail_threshold: u32, ttl: Option<Duration>) -> Registry {
    Registry::new(
        Arc::new(FleetMetrics::default()),
        HealthPolicy {
            fail_threshold,
            evicted_ttl: ttl,
            ..Default::default()
        },
    )
}

fn live_ports(r: &Registry, role: WorkerRole) -> Vec<String> {
    r.snapshot()
        .live(role)
        .iter()
        .map(|w| w.base.clone())
        .collect()
}

#[test]
fn registration_rules() {
    let r = registry(3, None);
    assert!(r.register(spec(WorkerRole::Prefill, 1)).unwrap());
    assert!(
        !r.register(spec(WorkerRole::Prefill, 1)).unwrap(),
        "same record: no-op"
    );
    assert_eq!(
        r.register(spec(WorkerRole::Decode, 1)),
        Err(RegistryError::RoleChange {
            url: "http://127.0.0.1:1".into(),
            existing: WorkerRole::Prefill,
            requested: WorkerRole::Decode
        })
    );
    assert!(matches!(
        r.register(spec(WorkerRole::PrefillDecode, 2)),
        Err(RegistryError::MixedTopology { .. })
    ));
    assert!(r.register(spec(WorkerRole::Encode, 3)).unwrap());
    // A changed dp_size updates the record in place and keeps its health.
    let mut wider = spec(WorkerRole::Prefill, 1);
    wider.dp_size = 4;
    assert!(!r.register(wider).unwrap());
    assert_eq!(r.snapshot().live(WorkerRole::Prefill)[0].spec.dp_size, 4);
    assert!(r.unregister("http://127.0.0.1:1"));
    assert!(!r.unregister("http://127.0.0.1:1"));
    // With no split worker left, prefill_decode may join.
    assert!(r.register(spec(WorkerRole::PrefillDecode, 2)).unwrap());
    assert!(matches!(
        r.register(spec(WorkerRole::Decode, 4)),
        Err(RegistryError::MixedTopology {
            existing: WorkerRole::PrefillDecode
        })
    ));
}

#[test]
fn eviction_readmission_and_mode() {
    let r = registry(3, None);
    r.register(spec(WorkerRole::Prefill, 1)).unwrap();
    r.register(spec(WorkerRole::Decode, 2)).unwrap();
    assert_eq!(r.snapshot().mode(), Mode::Disaggregated);
    let d = r.snapshot().live(WorkerRole::Decode)[0].clone();
    r.record_failure(&d, false, "probe");
    r.record_failure(&d, false, "probe");
    assert_eq!(
        r.snapshot().mode(),
        Mode::Disaggregated,
        "below the threshold"
    );
    r.record_success(&d);
    r.record_failure(&d, false, "probe");
    r.record_failure(&d, false, "probe");
    assert_eq!(
        live_ports(&r, WorkerRole::Decode).len(),
        1,
        "success reset the count"
    );
    r.record_failure(&d, false, "probe");
    assert_eq!(r.snapshot().mode(), Mode::Unavailable);
    assert_eq!(
        r.snapshot().missing(),
        vec![
            "no healthy decode worker is available: 1 evicted after failed health probes"
                .to_string()
        ]
    );
    r.record_success(&d);
    assert_eq!(r.snapshot().mode(), Mode::Disaggregated);
    // A refused connection evicts at once.
    r.record_failure(&d, true, "connection refused");
    assert!(live_ports(&r, WorkerRole::Decode).is_empty());
}

#[test]
fn a_stale_probe_result_cannot_revive_an_unregistered_worker() {
    let r = registry(1, None);
    r.register(spec(WorkerRole::Decode, 2)).unwrap();
    let d = r.snapshot().live(WorkerRole::Decode)[0].clone();
    r.record_failure(&d, false, "probe");
    assert!(r.unregister(&d.base));
    r.record_success(&d);
    assert!(r.snapshot().members().is_empty());
    // Re-registering creates a fresh record; the old handle still cannot touch it.
    r.register(spec(WorkerRole::Decode, 2)).unwrap();
    r.record_failure(&d, true, "stale");
    assert_eq!(live_ports(&r, WorkerRole::Decode).len(), 1);
}

#[test]
fn evicted_workers_are_forgotten_after_the_ttl() {
    let r = registry(1, Some(Duration::from_secs(10)));
    r.register(spec(WorkerRole::PrefillDecode, 1)).unwrap();
    let w = r.snapshot().live(WorkerRole::PrefillDecode)[0].clone();
    r.record_failure(&w, false, "probe");
    let evicted_at = r.snapshot().members()[0].evicted_since.unwrap();
    r.forget_expired(evicted_at + Duration::from_secs(9));
    assert_eq!(r.snapshot().members().len(), 1);
    r.forget_expired(evicted_at + Duration::from_secs(10));
    assert!(r.snapshot().members().is_empty());
    let forever = registry(1, None);
    forever
        .register(spec(WorkerRole::PrefillDecode, 1))
        .unwrap();
    let w = forever.snapshot().live(WorkerRole::PrefillDecode)[0].clone();
    forever.record_failure(&w, false, "probe");
    forever.forget_expired(Instant::now() + Duration::from_secs(1_000_000));
    assert_eq!(forever.snapshot().members().len(), 1);
}

#[test]
fn missing_roles_are_described() {
    let r = registry(3, None);
    assert_eq!(
        r.snapshot().missing(),
        vec![
            "no prefill worker is registered",
            "no decode worker is registered",
            "no prefill_decode worker is registered"
        ]
    );
    r.register(spec(WorkerRole::Prefill, 1)).unwrap();
    assert_eq!(
        r.snapshot().missing(),
        vec!["no decode worker is registered"]
    );
}

#[test]
fn assign_continues_the_rotation_across_calls_and_roster_changes() {
    let r = registry(3, None);
    assert!(r.assign(WorkerRole::Encode, 2).is_empty());
    r.register(spec(WorkerRole::Encode, 1)).unwrap();
    r.register(spec(WorkerRole::Encode, 2)).unwrap();
    let ports = |ws: Vec<Arc<Worker>>| {
        ws.iter()
            .map(|w| w.spec.url.port().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(ports(r.assign(WorkerRole::Encode, 3)), [1, 2, 1]);
    assert_eq!(ports(r.assign(WorkerRole::Encode, 1)), [2]);
    assert_eq!(ports(r.assign(WorkerRole::Encode, 1)), [1]);
    r.register(spec(WorkerRole::Encode, 3)).unwrap();
    // The cursor (5) continues over the new roster instead of restarting at its head.
    assert_eq!(ports(r.assign(WorkerRole::Encode, 2)), [3, 1]);
    assert!(r.assign(WorkerRole::Prefill, 1).is_empty());
}

#[test]
fn removed_workers_leave_no_metric_series_behind() {
    let mut exported = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(FleetMetrics::register(&mut exported));
    let encode = || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &exported).unwrap();
        text
    };
    let r = Registry::new(metrics, HealthPolicy::default());
    r.register(spec(WorkerRole::Decode, 7)).unwrap();
    assert!(encode().contains("http://127.0.0.1:7"));
    assert!(r.unregister("http://127.0.0.1:7"));
    assert!(!encode().contains("http://127.0.0.1:7"));
}

#[test]
fn the_roster_holds_at_most_max_workers() {
    let r = Registry::new(
        Arc::new(FleetMetrics::default()),
        HealthPolicy {
            max_workers: 2,
            ..Default::default()
        },
    );
    assert!(r.register(spec(WorkerRole::Decode, 1)).unwrap());
    assert!(r.register(spec(WorkerRole::Decode, 2)).unwrap());
    assert!(matches!(
        r.register(spec(WorkerRole::Decode, 3)),
        Err(RegistryError::Full { max: 2 })
    ));
    // Registering a worker already there again is still fine.
    assert!(!r.register(spec(WorkerRole::Decode, 2)).unwrap());
    assert!(r.unregister("http://127.0.0.1:1"));
    assert!(r.register(spec(WorkerRole::Decode, 3)).unwrap());
}

#[test]
fn a_source_is_kept_in_step_with_its_listing_and_leaves_other_sources_alone() {
    let r = registry(3, None);
    assert!(r
        .register_from(spec(WorkerRole::Decode, 1), WorkerSource::Static)
        .unwrap());
    // The file lists 1 (static already), 2 and 3: 2 and 3 are its own.
    let listing = |ports: &[u16]| ports.iter().map(|&p| spec(WorkerRole::Decode, p)).collect();
    let report = r.sync_source(WorkerSource::File, listing(&[1, 2, 3]));
    assert_eq!(report.added, ["http://127.0.0.1:2", "http://127.0.0.1:3"]);
    assert_eq!(report.refused.len(), 1, "{report:?}");
    assert!(report.refused[0].1.contains("static"), "{report:?}");
    // 3 vanishes from the file, 4 appears; 1 stays (the file never owned it).
    let report = r.sync_source(WorkerSource::File, listing(&[2, 4]));
    assert_eq!(report.removed, ["http://127.0.0.1:3"]);
    assert_eq!(report.added, ["http://127.0.0.1:4"]);
    let sources: Vec<(String, WorkerSource)> = r
        .snapshot()
        .members()
        .iter()
        .map(|m| (m.worker.base.clone(), m.source))
        .collect();
    assert_eq!(
        sources,
        [
            ("http://127.0.0.1:1".to_string(), WorkerSource::Static),
            ("http://127.0.0.1:2".to_string(), WorkerSource::File),
            ("http://127.0.0.1:4".to_string(), WorkerSource::File),
        ]
    );
    // A changed record is updated in place; an empty listing empties only the file's.
    let mut wide = spec(WorkerRole::Decode, 2);
    wide.dp_size = 2;
    let report = r.sync_source(WorkerSource::File, vec![wide, spec(WorkerRole::Decode, 4)]);
    assert_eq!(report.updated, ["http://127.0.0.1:2"]);
    let report = r.sync_source(WorkerSource::File, Vec::new());
    assert_eq!(report.removed.len(), 2);
    assert_eq!(live_ports(&r, WorkerRole::Decode), ["http://127.0.0.1:1"]);
}
