//! File discovery: the roster follows a watched listing (added, removed), keeps the last
//! good workers when the file is half-written, deleted or wrong, shows each worker's
//! source, and never takes a gateway for a worker.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Double, Role};
use crate::{bounded, client, metric, pd_config, Gateway, RosterRow};

/// A listing file in the temporary directory, removed when dropped.
struct Listing(PathBuf);

impl Listing {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "pdserve-discovery-{name}-{}.yaml",
            std::process::id()
        ));
        Self(path)
    }

    fn write(&self, text: &str) {
        // Written whole and renamed into place, as a deployment tool would.
        let tmp = self.0.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.0).unwrap();
    }

    fn list(&self, workers: &[(&str, &Double)]) {
        let mut text = String::from("workers:\n");
        for (role, double) in workers {
            text.push_str(&format!("  - url: {}\n    role: {role}\n", double.url));
        }
        self.write(&text);
    }
}

impl Drop for Listing {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn discovering(listing: &Listing) -> GatewayConfig {
    let mut config = GatewayConfig::new(Vec::new(), Vec::new(), Vec::new());
    config.discovery.file = Some(listing.0.clone());
    config.discovery.interval = Duration::from_millis(50);
    config
}

async fn wait_for_roster(gw: &Gateway, expected: &[RosterRow]) {
    gw.roster_becomes(expected, Instant::now()).await;
}

fn entry(double: &Double, role: &str) -> (String, String, String) {
    (double.url.clone(), role.to_string(), "file".to_string())
}

#[tokio::test]
async fn the_roster_follows_a_listing_file_and_keeps_its_workers_when_the_file_breaks() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let listing = Listing::new("follow");
        listing.list(&[("prefill", &p), ("decode", &d1)]);
        let gw = Gateway::start(discovering(&listing)).await;
        let first = [entry(&p, "prefill"), entry(&d1, "decode")];
        wait_for_roster(&gw, &first).await;
        assert_eq!(gw.chat_status().await, 200);

        // D2 joins, D1 leaves.
        listing.list(&[("prefill", &p), ("decode", &d2)]);
        let second = [entry(&p, "prefill"), entry(&d2, "decode")];
        wait_for_roster(&gw, &second).await;
        let before = d2.requests().len();
        assert_eq!(gw.chat_status().await, 200);
        assert!(d2.requests().len() > before);

        // Half-written, wrong and deleted files keep the last good roster, counted.
        for broken in [
            "workers:\n  - url: http://127.0.0.1:",
            "workers:\n  - url: http://127.0.0.1:9\n    role: cook\n",
            "",
        ] {
            let errors = metric(&gw, "pdserve_gateway_discovery_errors_total").await;
            listing.write(broken);
            for _ in 0..200 {
                if metric(&gw, "pdserve_gateway_discovery_errors_total").await > errors {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                metric(&gw, "pdserve_gateway_discovery_errors_total").await > errors,
                "{broken:?} was not reported"
            );
            assert_eq!(gw.roster().await, {
                let mut s = second.to_vec();
                s.sort();
                s
            });
        }
        std::fs::remove_file(&listing.0).unwrap();
        let errors = metric(&gw, "pdserve_gateway_discovery_errors_total").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(metric(&gw, "pdserve_gateway_discovery_errors_total").await > errors);
        assert_eq!(
            gw.chat_status().await,
            200,
            "a deleted file empties nothing"
        );

        // Back to a good listing: applied again.
        listing.list(&[("prefill", &p), ("decode", &d1)]);
        wait_for_roster(&gw, &first).await;
    })
    .await;
}

#[tokio::test]
async fn discovery_leaves_static_workers_alone_and_refuses_gateways() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let other = Gateway::start(GatewayConfig::new(Vec::new(), Vec::new(), Vec::new())).await;
        let listing = Listing::new("static");
        // The listing names the static decode worker too, and another gateway.
        listing.write(&format!(
            "workers:\n  - {{url: {}, role: decode}}\n  - {{url: {}, role: decode}}\n",
            d.url, other.url
        ));
        let mut config = pd_config(&[&p], &[&d]);
        config.discovery.file = Some(listing.0.clone());
        config.discovery.interval = Duration::from_millis(50);
        let gw = Gateway::start(config).await;
        for _ in 0..200 {
            if metric(&gw, "pdserve_gateway_workers_refused_total").await > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            metric(
                &gw,
                r#"pdserve_gateway_workers_refused_total{source="discovery",reason="gateway"}"#
            )
            .await,
            1.0
        );
        let static_only = [
            (p.url.clone(), "prefill".to_string(), "static".to_string()),
            (d.url.clone(), "decode".to_string(), "static".to_string()),
        ];
        wait_for_roster(&gw, &static_only).await;
        // An empty listing removes only what the file added: nothing here.
        listing.write("workers: []\n");
        tokio::time::sleep(Duration::from_millis(200)).await;
        wait_for_roster(&gw, &static_only).await;
        let instances: Value = gw.instances().await;
        assert_eq!(instances["workers"][0]["source"], "static", "{instances}");
    })
    .await;
}

/// Two gateway replicas on one listing, with session affinity: every request of a session
/// reaches the same decode worker whichever replica it went through, because both hash
/// the same key over the same roster.
#[tokio::test]
async fn replicas_on_one_listing_route_a_session_to_the_same_worker() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let decoders = [
            Double::start(Role::Decode, "D0").await,
            Double::start(Role::Decode, "D1").await,
            Double::start(Role::Decode, "D2").await,
        ];
        let listing = Listing::new("replicas");
        listing.list(&[
            ("prefill", &p),
            ("decode", &decoders[0]),
            ("decode", &decoders[1]),
            ("decode", &decoders[2]),
        ]);
        let replica = || {
            let mut config = discovering(&listing);
            config.decode_policy = Some("session".into());
            config
        };
        let replicas = [
            Gateway::start(replica()).await,
            Gateway::start(replica()).await,
        ];
        let expected: Vec<_> = std::iter::once(entry(&p, "prefill"))
            .chain(decoders.iter().map(|d| entry(d, "decode")))
            .collect();
        for gw in &replicas {
            wait_for_roster(gw, &expected).await;
        }
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        let mut owners = std::collections::HashSet::new();
        for session in 0..12 {
            let session = format!("session-{session}");
            let mut seen = Vec::new();
            for turn in 0..4 {
                let gw = &replicas[turn % 2];
                let counts: Vec<usize> = decoders.iter().map(|d| d.requests().len()).collect();
                let response = client()
                    .post(gw.at("/v1/chat/completions"))
                    .header("x-session-id", &session)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let served: Vec<usize> = (0..decoders.len())
                    .filter(|&i| decoders[i].requests().len() > counts[i])
                    .collect();
                assert_eq!(served.len(), 1, "{session} turn {turn}: {served:?}");
                seen.push(served[0]);
            }
            assert!(
                seen.iter().all(|&d| d == seen[0]),
                "{session} moved between decode workers across replicas: {seen:?}"
            );
            owners.insert(seen[0]);
        }
        assert!(owners.len() > 1, "sessions spread over the decode workers");
    })
    .await;
}
