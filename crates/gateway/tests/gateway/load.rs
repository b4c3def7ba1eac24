//! Load from the workers' own metrics: `power_of_two` sends nothing to a decode worker
//! that reports a long queue (load this gateway never sent it, e.g. another replica's),
//! two replicas agree on it, and a worker whose metrics stop answering falls back to the
//! gateway's own counts (counted as a scrape failure).

use std::time::Duration;

use pdserve_gateway::GatewayConfig;
use serde_json::Value;

use crate::double::{Double, Role};
use crate::{bounded, metric, pd_config, Gateway};

fn scraping(p: &Double, decoders: &[&Double]) -> GatewayConfig {
    let mut config = pd_config(&[p], decoders);
    config.decode_policy = Some("power_of_two".into());
    config.load_scrape_interval = Duration::from_millis(50);
    config
}

/// Waits until the gateway's roster shows `url` reporting `waiting` queued requests.
async fn until_reported(gw: &Gateway, url: &str, waiting: Option<f64>) {
    for _ in 0..300 {
        let instances = gw.instances().await;
        let worker = instances["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == url)
            .cloned()
            .unwrap_or(Value::Null);
        if worker["reported_load"]["waiting"].as_f64() == waiting {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{url} never reported {waiting:?}: {}", gw.instances().await);
}

#[tokio::test]
async fn replicas_balance_on_the_load_workers_report() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let busy = Double::start(Role::Decode, "busy").await;
        let idle = Double::start(Role::Decode, "idle").await;
        busy.report_queue(Some((40.0, 8.0)));
        idle.report_queue(Some((0.0, 1.0)));
        let replicas = [
            Gateway::start(scraping(&p, &[&busy, &idle])).await,
            Gateway::start(scraping(&p, &[&busy, &idle])).await,
        ];
        for gw in &replicas {
            until_reported(gw, &busy.url, Some(40.0)).await;
            until_reported(gw, &idle.url, Some(0.0)).await;
        }
        // Both replicas see the same queue, so neither sends the busy worker anything.
        for i in 0..20 {
            assert_eq!(replicas[i % 2].chat_status().await, 200);
        }
        assert_eq!(busy.requests().len(), 0);
        assert_eq!(idle.requests().len(), 20);

        // The queues move: traffic follows.
        busy.report_queue(Some((0.0, 0.0)));
        idle.report_queue(Some((30.0, 8.0)));
        for gw in &replicas {
            until_reported(gw, &idle.url, Some(30.0)).await;
            until_reported(gw, &busy.url, Some(0.0)).await;
        }
        for i in 0..10 {
            assert_eq!(replicas[i % 2].chat_status().await, 200);
        }
        assert_eq!(busy.requests().len(), 10);
        assert_eq!(idle.requests().len(), 20);

        // Metrics that stop answering: the report goes, the failure is counted, and
        // routing goes on with the gateway's own counts.
        idle.report_queue(None);
        let gw = &replicas[0];
        until_reported(gw, &idle.url, None).await;
        let failures = format!(
            r#"pdserve_gateway_load_scrape_failures_total{{worker="{}"}}"#,
            idle.url
        );
        assert!(metric(gw, &failures).await >= 1.0);
        let before = idle.requests().len();
        for _ in 0..20 {
            assert_eq!(gw.chat_status().await, 200);
        }
        assert!(
            idle.requests().len() > before,
            "with no report the idle-by-count worker takes requests again"
        );
    })
    .await;
}
