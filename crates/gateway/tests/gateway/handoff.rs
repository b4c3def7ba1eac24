//! The shape of both legs, header propagation, pass-through, aggregated mode, side routes.

use futures::StreamExt;
use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::double::{Behavior, Double, Role};
use crate::{bounded, client, pd_config, sse_data, urls, Gateway};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_legs_have_vllm_shape_and_share_headers() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let client_body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 4,
            "max_completion_tokens": 4,
            "min_tokens": 2,
            "temperature": 0.5,
            "chat_template_kwargs": {"enable_thinking": false}
        });
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .header("x-request-id", "req-42")
            .header("authorization", "Bearer sk-test")
            .json(&client_body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-request-id"], "req-42");
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let text = resp.text().await.unwrap();

        // Prefill leg: one token, not streamed, asks P to keep its blocks.
        let prefill = p.only_request();
        assert_eq!(prefill.path, "/v1/chat/completions");
        let mut want_prefill = client_body.clone();
        let obj = want_prefill.as_object_mut().unwrap();
        obj.remove("max_completion_tokens");
        obj.remove("min_tokens");
        obj.remove("stream_options");
        obj.insert("stream".into(), json!(false));
        obj.insert("max_tokens".into(), json!(1));
        obj.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                   "remote_engine_id": null, "remote_block_ids": null,
                   "remote_host": null, "remote_port": null}),
        );
        assert_eq!(prefill.body, want_prefill);

        // Decode leg: the original request plus P's handle, unchanged.
        let decode = d.only_request();
        let mut want_decode = client_body.clone();
        want_decode["kv_transfer_params"] = p.kv_handle("req-42");
        assert_eq!(decode.body, want_decode);

        for leg in [&prefill, &decode] {
            assert_eq!(leg.headers["x-request-id"], "req-42");
            assert_eq!(leg.headers["authorization"], "Bearer sk-test");
        }

        // The client got D's stream: role chunk, 4 tokens, [DONE].
        let data = sse_data(&text);
        assert_eq!(data.last().unwrap(), "[DONE]");
        assert_eq!(data.len(), 6, "{text}");
        let content: String = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect();
        assert_eq!(content, "tok0tok1tok2tok3");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_completion_returns_decode_json_with_one_generated_request_id() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/completions"))
            .json(&json!({"model": "m", "prompt": "once upon", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let request_id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(!request_id.is_empty());
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["text"], "tok0tok1");
        // D's KV handle names internal hosts and blocks: never shown to the client.
        assert!(body.get("kv_transfer_params").is_none(), "{body}");

        let prefill = p.only_request();
        let decode = d.only_request();
        assert_eq!(prefill.path, "/v1/completions");
        assert_eq!(prefill.body["stream"], false);
        assert_eq!(prefill.body["max_tokens"], 1);
        assert!(decode.body.get("stream").is_none());
        assert_eq!(decode.body["max_tokens"], 2);
        assert_eq!(decode.body["kv_transfer_params"], p.kv_handle(&request_id));
        for leg in [&prefill, &decode] {
            assert_eq!(leg.headers["x-request-id"], request_id.as_str());
            assert!(leg.headers.get("authorization").is_none());
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_chunks_reach_the_client_before_the_worker_finishes() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        d.set(Behavior::Gated);
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let resp = client()
            .post(gw.at("/v1/chat/completions"))
            .json(
                &json!({"messages": [{"role": "user", "content": "hi"}], "stream": true,
                          "max_tokens": 3}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let mut seen = String::new();
        // The double holds back everything after the first token until released.
        while !seen.contains("tok0") {
            let chunk = body.next().await.expect("stream ended early").unwrap();
            seen.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        assert!(!seen.contains("[DONE]"));
        d.release();
        while let Some(chunk) = body.next().await {
            seen.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        assert!(seen.ends_with("data: [DONE]\n\n"), "{seen}");
        assert!(seen.contains("tok2"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_workers_serve_when_no_pd_pool_is_configured() {
    bounded(async {
        let w = Double::start(Role::Decode, "W").await;
        let gw = Gateway::start(GatewayConfig::new(vec![], vec![], urls(&[&w]))).await;
        let client_body = json!({"model": "m", "prompt": "x", "stream": true, "max_tokens": 2,
                                 "conversation_id": "c9", "min_tokens": 1});
        let resp = client()
            .post(gw.at("/v1/completions"))
            .json(&client_body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let data = sse_data(&resp.text().await.unwrap());
        assert_eq!(data.last().unwrap(), "[DONE]");
        let mut want = client_body.clone();
        want.as_object_mut().unwrap().remove("conversation_id");
        assert_eq!(w.only_request().body, want);
        let health = gw.health().await;
        assert_eq!(health["mode"], "aggregated");
        assert_eq!(health["status"], "ok");
        assert_eq!(health["cached_conversations"], 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let d2 = Double::start(Role::Decode, "D2").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d1, &d2])).await;
        let models: Value = client()
            .get(gw.at("/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["id"], "m");

        let health = gw.health().await;
        assert_eq!(health["status"], "ok");
        assert_eq!(health["mode"], "disaggregated");
        assert_eq!(
            health["live_workers"],
            json!({"prefill": 1, "decode": 2, "prefill_decode": 0, "encode": 0})
        );
        assert_eq!(health["cached_conversations"], 0);

        // Round-robin across the decode pool.
        for _ in 0..2 {
            let resp = client()
                .post(gw.at("/v1/chat/completions"))
                .json(&json!({"messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
        }
        assert_eq!(d1.requests().len(), 1);
        assert_eq!(d2.requests().len(), 1);

        let metrics = client()
            .get(gw.at("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for needle in [
            r#"pdserve_gateway_requests_total{route="/v1/chat/completions",status="200"} 2"#,
            r#"pdserve_gateway_requests_total{route="/v1/models",status="200"} 1"#,
            "pdserve_gateway_prefill_seconds_count 2",
            "pdserve_gateway_decode_ttfb_seconds_count 2",
            r#"pdserve_gateway_request_seconds_count{route="/v1/chat/completions"} 2"#,
            r#"pdserve_gateway_worker_in_flight{role="decode","#,
        ] {
            assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
        }
        // Nothing is left open on any worker.
        let instances = gw.instances().await;
        let workers = instances["workers"].as_array().unwrap();
        assert_eq!(workers.len(), 3, "{instances}");
        for w in workers {
            assert_eq!(w["in_flight"], 0, "{instances}");
            assert_eq!(w["health"], "live", "{instances}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_returns_when_its_shutdown_future_completes() {
    bounded(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/liveness", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(pdserve_gateway::serve(
            listener,
            GatewayConfig::new(vec![], vec![], vec![]),
            async {
                let _ = rx.await;
            },
        ));
        assert_eq!(client().get(&url).send().await.unwrap().status(), 200);
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
        assert!(
            client().get(&url).send().await.is_err(),
            "nothing listens any more"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_retired_before_the_worker_closes_them() {
    bounded(async {
        let w = Double::start(Role::Decode, "W").await;
        // The client ports of `n` sequential requests, 400 ms apart.
        let peers = |idle_ms: u64, n: usize| {
            let w = &w;
            async move {
                let mut config = GatewayConfig::new(vec![], vec![], urls(&[w]));
                config.upstream_idle_timeout = std::time::Duration::from_millis(idle_ms);
                let gw = Gateway::start(config).await;
                let before = w.requests().len();
                for _ in 0..n {
                    let resp = client()
                        .post(gw.at("/v1/completions"))
                        .json(&json!({"prompt": "x"}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(resp.status(), 200);
                    resp.bytes().await.unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
                }
                let requests = w.requests();
                requests[before..]
                    .iter()
                    .map(|r| r.peer)
                    .collect::<std::collections::HashSet<_>>()
            }
        };
        // A connection idle past the pool timeout is not reused...
        assert_eq!(peers(100, 2).await.len(), 2);
        // ...while one within it is (so the check above is meaningful). The gateway's
        // own `/v1/models` look-up of a new worker may open a second pooled connection
        // beside the first request's, so four requests use at most two.
        let distinct = peers(60_000, 4).await;
        assert!(distinct.len() <= 2, "{distinct:?}");
    })
    .await;
}

/// `n` > 1 goes as one P/D pair per choice (vLLM's decode reads a handle once per
/// choice), choice `i` seeded `seed + i`; the answer is one: choices in order, the prompt
/// counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_of_n_has_its_own_pair_of_legs() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d = Double::start(Role::Decode, "D").await;
        let gw = Gateway::start(pd_config(&[&p], &[&d])).await;
        let body = json!({
            "model": "m", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3, "temperature": 0.7, "seed": 7, "n": 2,
        });
        let answer: Value = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut seeds: Vec<(u64, Option<u64>)> = p
            .requests()
            .iter()
            .chain(d.requests().iter())
            .map(|leg| {
                assert_eq!(leg.body.get("n"), None, "a leg asked for several choices");
                (
                    leg.body["max_tokens"].as_u64().unwrap(),
                    leg.body["seed"].as_u64(),
                )
            })
            .collect();
        seeds.sort();
        assert_eq!(
            seeds,
            [(1, Some(7)), (1, Some(8)), (3, Some(7)), (3, Some(8))]
        );
        let indices: Vec<u64> = answer["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect();
        assert_eq!(indices, [0, 1], "{answer}");
        assert_eq!(answer["usage"]["prompt_tokens"], 5);
        assert_eq!(answer["usage"]["completion_tokens"], 6);
        assert_eq!(answer["usage"]["total_tokens"], 11);
        assert_eq!(answer.get("kv_transfer_params"), None);

        // Streamed: both choices' events, one id, one [DONE].
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = client()
            .post(gw.at("/v1/chat/completions"))
            .json(&streamed)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let data = sse_data(&text);
        assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "{text}");
        let chunks: Vec<Value> = data
            .iter()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let mut per_choice = [0, 0];
        for chunk in &chunks {
            assert_eq!(chunk["id"], chunks[0]["id"]);
            if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
                let i = chunk["choices"][0]["index"].as_u64().unwrap() as usize;
                per_choice[i] += usize::from(!text.is_empty());
            }
        }
        assert_eq!(per_choice, [3, 3], "{text}");
    })
    .await;
}
