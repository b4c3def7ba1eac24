//! Routing on KV events: `precise_prefix` and `cache_aware --cache-source` against fake
//! publishers the test drives; what each choice matched, in the `--expose-routing`
//! headers; an event stream that falls silent while its worker is sent new prompts goes
//! stale and routing falls back to the approximate tree until the stream speaks again.

use std::time::Duration;

use pdserve_gateway::policy::CacheSource;
use pdserve_gateway::GatewayConfig;
use pdserve_protocol::kv_events::{EngineBlockHash, KvCacheEvent};
use serde_json::json;

use crate::double::{Double, Role};
use crate::kv_events::{stored, wait_metric, FakePublisher};
use crate::{bounded, client, Gateway};

/// Two aggregated doubles, each with its own fake publisher, under `precise_prefix`.
async fn precise_pair() -> (
    Double,
    Double,
    FakePublisher,
    FakePublisher,
    pdserve_gateway::GatewayConfig,
) {
    let a = Double::start(Role::Decode, "A").await;
    let b = Double::start(Role::Decode, "B").await;
    let (pub_a, pub_b) = (FakePublisher::start().await, FakePublisher::start().await);
    let mut config =
        pdserve_gateway::GatewayConfig::new(Vec::new(), Vec::new(), crate::urls(&[&a, &b]));
    config.policy = "precise_prefix".into();
    for (double, publisher) in [(&a, &pub_a), (&b, &pub_b)] {
        config
            .kv_events
            .publishers
            .insert(double.url.clone(), publisher.endpoint.clone());
    }
    (a, b, pub_a, pub_b, config)
}

/// `precise_prefix` sends a prompt to the worker whose events hold it, unless that
/// worker's reported load costs more than the cached tokens are worth; a prompt nobody
/// holds goes to the less loaded worker.
#[tokio::test]
async fn precise_prefix_routes_on_the_events_net_of_load() {
    bounded(async {
        let (a, b, mut pub_a, mut pub_b, mut config) = precise_pair().await;
        config.load_scrape_interval = Duration::from_millis(50);
        a.report_queue(Some((0.0, 0.0)));
        b.report_queue(Some((0.0, 0.0)));
        let gw = Gateway::start(config).await;
        let mut seq_a = pub_a.until_heard(&gw).await;
        let seq_b = pub_b.until_heard(&gw).await;
        // B's cache holds the 16-token prompt (4 blocks of 4), A's nothing.
        let prompt: Vec<u32> = (0..16).map(|t| t + 500).collect();
        pub_b
            .publish(
                seq_b,
                vec![KvCacheEvent::BlockStored {
                    block_hashes: (1..=4).map(EngineBlockHash::Int).collect(),
                    parent_block_hash: None,
                    token_ids: prompt.clone(),
                    block_size: 4,
                    lora_id: None,
                    medium: None,
                    lora_name: None,
                }],
            )
            .await;
        // A says its block size too (an unrelated block), so both are indexed.
        pub_a.publish(seq_a, vec![stored(90, 1, 4)]).await;
        seq_a += 1;
        let _ = seq_a;
        let b_blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, b.url);
        wait_metric(&gw, &b_blocks, 4.0).await;
        let complete = |tokens: Vec<u32>| {
            let url = gw.at("/v1/completions");
            async move {
                client()
                    .post(url)
                    .json(&json!({"prompt": tokens, "max_tokens": 2}))
                    .send()
                    .await
                    .unwrap()
                    .status()
            }
        };
        for _ in 0..5 {
            assert_eq!(complete(prompt.clone()).await, 200);
        }
        assert_eq!(
            (a.requests().len(), b.requests().len()),
            (0, 5),
            "cached: to B"
        );

        // B reports a queue whose cost (0.1 × 20 requests × 16 tokens) outweighs its
        // 16 cached tokens: A takes the prompt.
        b.report_queue(Some((20.0, 0.0)));
        for _ in 0..200 {
            let instances = gw.instances().await;
            let reported = instances["workers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["url"] == b.url && w["reported_load"]["waiting"] == 20.0);
            if reported {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(complete(prompt.clone()).await, 200);
        assert_eq!(
            (a.requests().len(), b.requests().len()),
            (1, 5),
            "net of load: to A"
        );
    })
    .await;
}

/// Before a worker's events report a new prefix, the prompts just sent there count as
/// held there: requests sharing a new prefix all go to the worker computing it.
#[tokio::test]
async fn precise_prefix_keeps_a_new_prefix_on_the_worker_computing_it() {
    bounded(async {
        let (a, b, mut pub_a, mut pub_b, mut config) = precise_pair().await;
        config.load_scrape_interval = Duration::ZERO;
        let gw = Gateway::start(config).await;
        pub_a.until_heard(&gw).await;
        pub_b.until_heard(&gw).await;
        let shared: Vec<u32> = (0..64).map(|t| t + 900).collect();
        for question in 0..6u32 {
            let mut prompt = shared.clone();
            prompt.extend([question, question + 1]);
            let status = client()
                .post(gw.at("/v1/completions"))
                .json(&json!({"prompt": prompt, "max_tokens": 2}))
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status, 200);
        }
        let (to_a, to_b) = (a.requests().len(), b.requests().len());
        assert!(
            (to_a, to_b) == (6, 0) || (to_a, to_b) == (0, 6),
            "one worker computes the new prefix: {to_a} / {to_b}"
        );
    })
    .await;
}

/// Sends a token-id completion; returns the worker that answered and what it matched
/// (the `x-pdserve-worker` and `x-pdserve-worker-cache` headers).
async fn routed(gw: &Gateway, prompt: &[u32]) -> (String, String) {
    let response = client()
        .post(gw.at("/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .to_str()
            .unwrap()
            .to_string()
    };
    (header("x-pdserve-worker"), header("x-pdserve-worker-cache"))
}

/// A block of `prompt`'s tokens stored in blocks of 4, hashed from `first`.
fn holds(prompt: &[u32], first: u64) -> KvCacheEvent {
    KvCacheEvent::BlockStored {
        block_hashes: (first..first + prompt.len() as u64 / 4)
            .map(EngineBlockHash::Int)
            .collect(),
        parent_block_hash: None,
        token_ids: prompt.to_vec(),
        block_size: 4,
        lora_id: None,
        medium: None,
        lora_name: None,
    }
}

/// `cache_aware` with A publishing events and B not: `auto` reads A's events and B's
/// tree, `events` reads events only (B holds what was just sent it), `approximate` the
/// trees only; the header says which, with the match in tokens.
#[tokio::test]
async fn cache_aware_reads_events_or_trees_as_the_cache_source_says() {
    bounded(async {
        let cached: Vec<u32> = (0..16).map(|t| t + 700).collect();
        let fresh: Vec<u32> = (0..16).map(|t| t + 3000).collect();
        for source in [
            CacheSource::Auto,
            CacheSource::Events,
            CacheSource::Approximate,
        ] {
            let a = Double::start(Role::Decode, "A").await;
            let b = Double::start(Role::Decode, "B").await;
            let mut pub_a = FakePublisher::start().await;
            let mut config = GatewayConfig::new(Vec::new(), Vec::new(), crate::urls(&[&a, &b]));
            config.policy = "cache_aware".into();
            config.policy_config.cache_source = source;
            config.expose_routing = true;
            config.load_scrape_interval = Duration::ZERO;
            config
                .kv_events
                .publishers
                .insert(a.url.clone(), pub_a.endpoint.clone());
            let gw = Gateway::start(config).await;
            let seq = pub_a.until_heard(&gw).await;
            pub_a.publish(seq, vec![holds(&cached, 1)]).await;
            let a_blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, a.url);
            wait_metric(&gw, &a_blocks, 4.0).await;

            let (worker, cache) = routed(&gw, &cached).await;
            if source == CacheSource::Approximate {
                assert_eq!(
                    cache, "approximate; matched=0; prompt=16; unit=tokens",
                    "{source:?}"
                );
            } else {
                assert_eq!(worker, a.url, "{source:?}: A's events hold the prompt");
                assert_eq!(
                    cache, "events; matched=16; prompt=16; unit=tokens",
                    "{source:?}"
                );
            }
            // A prompt nobody holds, twice: the second follows the first, matched by the
            // source this worker is read from.
            let (first, _) = routed(&gw, &fresh).await;
            let (second, cache) = routed(&gw, &fresh).await;
            assert_eq!(
                first, second,
                "{source:?}: the new prefix stays where it went"
            );
            let expected = match source {
                CacheSource::Auto if second == a.url => "events",
                CacheSource::Auto | CacheSource::Approximate => "approximate",
                CacheSource::Events => "events",
            };
            assert_eq!(
                cache,
                format!("{expected}; matched=16; prompt=16; unit=tokens"),
                "{source:?}, worker {second}"
            );
        }
    })
    .await;
}

/// A worker sent prompts to compute whose stream says nothing for
/// `--kv-events-stale-secs` goes stale: the gauge says so, a rebuild is counted, and
/// routing falls back to the approximate tree; the next batch makes it trusted again.
#[tokio::test]
async fn a_silent_event_stream_goes_stale_and_routing_falls_back() {
    bounded(async {
        let a = Double::start(Role::Decode, "A").await;
        let mut pub_a = FakePublisher::start().await;
        let mut config = GatewayConfig::new(Vec::new(), Vec::new(), crate::urls(&[&a]));
        config.policy = "precise_prefix".into();
        config.expose_routing = true;
        config.load_scrape_interval = Duration::ZERO;
        config.kv_events.stale_after = Duration::from_millis(300);
        config
            .kv_events
            .publishers
            .insert(a.url.clone(), pub_a.endpoint.clone());
        let gw = Gateway::start(config).await;
        let mut seq = pub_a.until_heard(&gw).await;
        pub_a.publish(seq, vec![stored(50, 1, 4)]).await;
        seq += 1;
        let stale = format!(r#"pdserve_gateway_kv_index_stale{{worker="{}"}}"#, a.url);
        let rebuilds = format!(
            r#"pdserve_gateway_kv_index_rebuilds_total{{worker="{}",reason="stale"}}"#,
            a.url
        );
        let a_blocks = format!(r#"pdserve_gateway_kv_index_blocks{{worker="{}"}}"#, a.url);
        wait_metric(&gw, &a_blocks, 1.0).await;
        assert_eq!(crate::metric(&gw, &stale).await, 0.0);

        // Idle, the stream owes nothing and stays trusted however long it is silent.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(
            crate::metric(&gw, &stale).await,
            0.0,
            "an idle stream is not stale"
        );

        // A prompt to compute, and no events for it: stale.
        let prompt: Vec<u32> = (0..32).map(|t| t + 1200).collect();
        let (_, cache) = routed(&gw, &prompt).await;
        assert_eq!(cache, "events; matched=0; prompt=32; unit=tokens");
        wait_metric(&gw, &stale, 1.0).await;
        assert_eq!(crate::metric(&gw, &rebuilds).await, 1.0);
        assert_eq!(
            crate::metric(&gw, &a_blocks).await,
            0.0,
            "a stale index is cleared"
        );
        let (_, cache) = routed(&gw, &prompt).await;
        assert!(
            cache.starts_with("approximate;"),
            "a stale index is not trusted: {cache}"
        );

        // The stream speaks again: trusted again, and what it says is routed on.
        pub_a.publish(seq, vec![holds(&prompt, 100)]).await;
        wait_metric(&gw, &stale, 0.0).await;
        wait_metric(&gw, &a_blocks, 8.0).await;
        let (_, cache) = routed(&gw, &prompt).await;
        assert_eq!(cache, "events; matched=32; prompt=32; unit=tokens");
        assert_eq!(crate::metric(&gw, &rebuilds).await, 1.0);
    })
    .await;
}

/// In P/D each leg's choice is reported in its own header; a text prompt without
/// `--tokenizer` is matched by the approximate tree, in characters; a policy that does
/// not match prompts reports nothing.
#[tokio::test]
async fn each_p_d_leg_reports_its_match() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        for policy in ["cache_aware", "round_robin"] {
            let mut config = crate::pd_config(&[&p], &[&d]);
            config.policy = policy.into();
            config.expose_routing = true;
            let gw = Gateway::start(config).await;
            let chat = json!({"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 3});
            let mut last = Vec::new();
            for _ in 0..2 {
                let response = client()
                    .post(gw.at("/v1/chat/completions"))
                    .json(&chat)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                last = ["x-pdserve-prefill-cache", "x-pdserve-decode-cache"]
                    .map(|h| response.headers().get(h).map(|v| v.to_str().unwrap().to_string()))
                    .to_vec();
            }
            if policy == "round_robin" {
                assert_eq!(last, vec![None, None], "round_robin matches nothing");
                continue;
            }
            for header in last {
                let header = header.expect("both legs report their match");
                let fields: Vec<&str> = header.split("; ").collect();
                assert_eq!(fields[0], "approximate", "{header}");
                assert_eq!(fields[3], "unit=chars", "{header}");
                let matched = fields[1].strip_prefix("matched=").unwrap();
                let prompt = fields[2].strip_prefix("prompt=").unwrap();
                assert_eq!(matched, prompt, "the second turn matches all of it: {header}");
            }
        }
    })
    .await;
}
