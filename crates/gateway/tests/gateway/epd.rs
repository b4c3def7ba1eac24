//! Encoder disaggregation (E+PD and E+P+D) against vLLM-wire-format doubles: fan-out,
//! uuids, the metadata rewrite, and what the prefill/decode workers receive.

use pdserve_gateway::GatewayConfig;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::double::{Double, Role};
use crate::encoder::{items_of, metadata_for, Behavior, Encoder};
use crate::{bounded, client, sse_data, urls, Gateway};

pub fn image(name: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": format!("http://media/{name}.png")}})
}

pub fn input_audio() -> Value {
    json!({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}})
}

pub fn video() -> Value {
    json!({"type": "video_url", "video_url": {"url": "http://media/clip.mp4"}})
}

pub fn sha(s: &str) -> String {
    format!("{:x}", Sha256::digest(s.as_bytes()))
}

/// A chat request whose user message has a text part and `media`.
pub fn mm_request(media: &[Value], stream: bool) -> Value {
    let mut parts = vec![json!({"type": "text", "text": "What is in these?"})];
    parts.extend(media.iter().cloned());
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": parts},
        ],
        "max_tokens": 3,
        "temperature": 0.2,
        "stream": stream,
        "mm_processor_kwargs": {"max_pixels": 1024},
        "media_io_kwargs": {"video": {"num_frames": 4}},
        "priority": 2,
        "session_id": "s-1",
    })
}

/// A gateway with `encoders` in front of P/D (`prefill` and `decode`) or prefill_decode
/// (`worker`) doubles; `tweak` adjusts the configuration.
pub async fn epd_gateway(
    encoders: &[&Encoder],
    prefill: &[&Double],
    decode: &[&Double],
    worker: &[&Double],
    tweak: impl FnOnce(&mut GatewayConfig),
) -> Gateway {
    let mut config = GatewayConfig::new(urls(prefill), urls(decode), urls(worker));
    config.encode = encoders
        .iter()
        .map(|e| pdserve_gateway::fleet::registry::parse_worker_url("test", &e.url).unwrap())
        .collect();
    tweak(&mut config);
    Gateway::start(config).await
}

/// POSTs a chat body with `x-request-id: id`; returns the status and the body text.
pub async fn chat(gateway: &Gateway, id: &str, body: &Value) -> (u16, String) {
    let response = client()
        .post(gateway.at("/v1/chat/completions"))
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// Sub-requests ordered by the index of their first item (`<id>:<index>:<random>`).
pub fn by_first_item(mut subs: Vec<crate::encoder::Recorded>) -> Vec<crate::encoder::Recorded> {
    let first = |r: &crate::encoder::Recorded| -> usize {
        let id = r.headers["x-request-id"].to_str().unwrap();
        id.split(':').rev().nth(1).unwrap().parse().unwrap()
    };
    subs.sort_by_key(first);
    subs
}

/// The user message's parts of a recorded body.
pub fn user_parts(body: &Value) -> Value {
    body["messages"][1]["content"].clone()
}

#[tokio::test]
async fn e_pd_sends_media_to_the_encoder_and_metadata_to_the_worker() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |_| {}).await;
        let media = [image("a"), image("b"), video(), input_audio()];
        let (status, body) = chat(&gateway, "req-1", &mm_request(&media, false)).await;
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["object"], "chat.completion");

        // Both images in one sub-request, the video and the audio one each (sub-requests
        // run concurrently: order them by their first item, from the child request id).
        let subs = by_first_item(encoder.requests());
        let batches: Vec<Vec<Value>> = subs.iter().map(|r| items_of(&r.body)).collect();
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [2, 1, 1]);
        let uuid_a = sha("http://media/a.png");
        let audio_uuid = sha(r#"{"input_audio": {"data": "UklGRg==", "format": "wav"}, "type": "input_audio"}"#);
        assert_eq!(batches[0][0]["uuid"], uuid_a);
        assert_eq!(batches[0][1]["uuid"], sha("http://media/b.png"));
        assert_eq!(batches[1][0]["uuid"], sha("http://media/clip.mp4"));
        assert_eq!(batches[2][0]["uuid"], audio_uuid);
        for (sub, first) in subs.iter().zip([0, 2, 3]) {
            // vLLM's encoder request: media only, not streamed, passthrough fields.
            assert_eq!(
                sub.body,
                json!({
                    "model": "m",
                    "messages": [{"role": "user", "content": items_of(&sub.body)}],
                    "stream": false,
                    "mm_processor_kwargs": {"max_pixels": 1024},
                    "media_io_kwargs": {"video": {"num_frames": 4}},
                    "priority": 2,
                    "session_id": "s-1",
                })
            );
            let id = sub.headers["x-request-id"].to_str().unwrap();
            let (prefix, random) = id.rsplit_once(':').unwrap();
            assert_eq!(prefix, format!("req-1:{first}"));
            assert!(random.len() == 6 && random.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }

        let sent = worker.only_request();
        assert_eq!(sent.headers["x-request-id"], "req-1");
        assert_eq!(
            user_parts(&sent.body),
            json!([
                {"type": "text", "text": "What is in these?"},
                {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": uuid_a},
                {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]},
                 "uuid": sha("http://media/b.png")},
                {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4],
                 "second_per_grid_ts": [0.5]}, "uuid": sha("http://media/clip.mp4")},
                {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [25]},
                 "uuid": audio_uuid},
            ])
        );
        assert_eq!(sent.body["messages"][0], json!({"role": "system", "content": "Answer briefly."}));
        assert_eq!((sent.body["max_tokens"].clone(), sent.body["priority"].clone()), (json!(3), json!(2)));
        // The connector handles, keyed by mm_hash, and one transfer per rewritten item.
        let params = &sent.body["ec_transfer_params"];
        assert_eq!(params[&uuid_a]["peer_host"], "127.0.0.1");
        assert_eq!(params[&uuid_a]["metadata"], metadata_for("image_url"));
        assert_eq!(params["ec_items"].as_array().unwrap().len(), 4);
        assert_eq!(params["ec_items"][0]["mm_hash"], uuid_a);
        assert!(sent.headers.get("x-data-parallel-rank").is_none());
    })
    .await;
}

#[tokio::test]
async fn e_p_d_prefill_and_decode_both_get_the_rewritten_request() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let prefill = Double::start(Role::Prefill, "p").await;
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = epd_gateway(&[&encoder], &[&prefill], &[&decode], &[], |_| {}).await;
        let (status, body) = chat(&gateway, "req-2", &mm_request(&[image("a")], true)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(sse_data(&body).last().map(String::as_str), Some("[DONE]"));
        assert_eq!(encoder.requests().len(), 1);

        let p = prefill.only_request().body;
        assert_eq!(user_parts(&p)[1]["type"], "image_embeds");
        assert_eq!(
            (p["stream"].clone(), p["max_tokens"].clone()),
            (json!(false), json!(1))
        );
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        let uuid = sha("http://media/a.png");
        assert_eq!(p["ec_transfer_params"][&uuid]["peer_port"], 7000);

        let d = decode.only_request().body;
        assert_eq!(user_parts(&d), user_parts(&p));
        assert_eq!(d["ec_transfer_params"], p["ec_transfer_params"]);
        assert_eq!(d["kv_transfer_params"], prefill.kv_handle("req-2"));
        assert_eq!(
            (d["stream"].clone(), d["max_tokens"].clone()),
            (json!(true), json!(3))
        );
    })
    .await;
}

#[tokio::test]
async fn fan_out_groups_images_per_encoder_and_the_cursor_continues_across_requests() {
    bounded(async {
        let (e0, e1) = (Encoder::start("e0").await, Encoder::start("e1").await);
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&e0, &e1], &[], &[], &[&worker], |_| {}).await;
        let audio = json!({"type": "audio_url", "audio_url": {"url": "http://media/a.wav"}});
        let media = [image("0"), image("1"), image("2"), audio];
        assert_eq!(
            chat(&gateway, "r1", &mm_request(&media, false)).await.0,
            200
        );
        let urls = |batch: &Vec<Value>| {
            batch
                .iter()
                .map(|i| {
                    i[i["type"].as_str().unwrap()]["url"]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect::<Vec<_>>()
        };
        // Items 0..4 go to e0, e1, e0, e1: e0 batches its two images, e1 has an image and
        // the audio item, which always travels alone.
        assert_eq!(
            e0.item_batches().iter().map(urls).collect::<Vec<_>>(),
            [["http://media/0.png", "http://media/2.png"]]
        );
        let e1_batches: Vec<_> = by_first_item(e1.requests())
            .iter()
            .map(|r| urls(&items_of(&r.body)))
            .collect();
        assert_eq!(
            e1_batches,
            [vec!["http://media/1.png"], vec!["http://media/a.wav"]]
        );
        // The cursor stands at 4: the next single-image requests alternate from e0.
        assert_eq!(
            chat(&gateway, "r2", &mm_request(&[image("x")], false))
                .await
                .0,
            200
        );
        assert_eq!(
            chat(&gateway, "r3", &mm_request(&[image("y")], false))
                .await
                .0,
            200
        );
        assert_eq!(e0.requests().len(), 2);
        assert_eq!(urls(&e0.item_batches()[1]), ["http://media/x.png"]);
        assert_eq!(urls(&e1.item_batches()[2]), ["http://media/y.png"]);
    })
    .await;
}

#[tokio::test]
async fn encoder_max_batch_size_splits_an_encoders_images() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |c| {
            c.encoder_max_batch_size = 2;
        })
        .await;
        let media = [image("0"), image("1"), image("2"), image("3"), image("4")];
        assert_eq!(chat(&gateway, "r", &mm_request(&media, false)).await.0, 200);
        let subs = by_first_item(encoder.requests());
        let sizes: Vec<usize> = subs.iter().map(|r| items_of(&r.body).len()).collect();
        assert_eq!(sizes, [2, 2, 1]);
        let ids: Vec<String> = subs
            .iter()
            .map(|r| r.headers["x-request-id"].to_str().unwrap().to_string())
            .collect();
        for (id, first) in ids.iter().zip([0, 2, 4]) {
            assert!(id.starts_with(&format!("r:{first}:")), "{id}");
        }
        // Every item was rewritten, in order.
        let parts = user_parts(&worker.only_request().body);
        let uuids: Vec<_> = parts.as_array().unwrap()[1..]
            .iter()
            .map(|p| p["uuid"].clone())
            .collect();
        let expected: Vec<_> = (0..5)
            .map(|i| json!(sha(&format!("http://media/{i}.png"))))
            .collect();
        assert_eq!(uuids, expected);
    })
    .await;
}

#[tokio::test]
async fn uuids_are_content_derived_and_equal_for_equal_media() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |_| {}).await;
        let own = json!({"type": "image_url", "image_url": {"url": "http://media/z.png"}, "uuid": "client-key"});
        for id in ["first", "second"] {
            let body = mm_request(&[image("same"), own.clone()], false);
            assert_eq!(chat(&gateway, id, &body).await.0, 200);
        }
        let batches = encoder.item_batches();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0], batches[1], "same media, same keys, whatever the request");
        assert_eq!(batches[0][0]["uuid"], sha("http://media/same.png"));
        assert_eq!(batches[0][1]["uuid"], "client-key");
        let sent = worker.requests();
        assert_eq!(user_parts(&sent[0].body), user_parts(&sent[1].body));
    })
    .await;
}

#[tokio::test]
async fn unreported_items_stay_raw_and_audio_keeps_the_whole_request_raw() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |_| {}).await;

        // An encoder that reports nothing: the worker gets the original media.
        encoder.set(Behavior::Silent);
        let request = mm_request(&[image("a")], false);
        assert_eq!(chat(&gateway, "silent", &request).await.0, 200);
        let sent = worker.requests().pop().unwrap().body;
        assert_eq!(sent["messages"], request["messages"]);
        assert!(sent.get("ec_transfer_params").is_none());

        // Metadata for the image but not for the audio item: nothing is rewritten, every
        // item keeps its uuid.
        encoder.set(Behavior::Custom(std::sync::Arc::new(|body: &Value| {
            let item = &items_of(body)[0];
            if item["type"] == "input_audio" {
                return json!({});
            }
            json!({item["uuid"].as_str().unwrap(): {"metadata": metadata_for("image_url")}})
        })));
        let request = mm_request(&[image("a"), input_audio()], false);
        assert_eq!(chat(&gateway, "audio", &request).await.0, 200);
        let parts = user_parts(&worker.requests().pop().unwrap().body);
        assert_eq!(parts[1]["type"], "image_url");
        assert_eq!(parts[1]["uuid"], sha("http://media/a.png"));
        assert_eq!(parts[2]["type"], "input_audio");
        assert_eq!(parts[2]["uuid"].as_str().unwrap().len(), 64);
        assert_eq!(
            parts[2]["input_audio"],
            request["messages"][1]["content"][2]["input_audio"]
        );
    })
    .await;
}

#[tokio::test]
async fn bad_or_duplicate_item_indices_are_502() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |_| {}).await;
        for (reply, why) in [
            (
                json!({"h": {"metadata": {}, "item_indices": [0, 7]}}),
                "invalid encoder item index",
            ),
            (
                json!({"h": {"metadata": {}, "item_indices": [0]}, "k": {"item_indices": [0, 1]}}),
                "duplicate encoder item index",
            ),
        ] {
            encoder.set(Behavior::Custom(std::sync::Arc::new(move |_| {
                reply.clone()
            })));
            let (status, body) = chat(
                &gateway,
                "bad",
                &mm_request(&[image("a"), image("b")], false),
            )
            .await;
            assert_eq!(status, 502, "{body}");
            assert!(body.contains(why), "{body}");
        }
        assert!(worker.requests().is_empty());
    })
    .await;
}

#[tokio::test]
async fn the_consumers_rank_and_push_address_are_named_to_encoders_and_consumer() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[], |c| {
            c.admin_api_key = Some("k".into());
        })
        .await;
        let registered = client()
            .post(gateway.at("/instances"))
            .header("x-api-key", "k")
            .json(
                &json!({"role": "prefill_decode", "url": worker.url, "dp_size": 2,
                          "ec_zmq_addrs": ["tcp://127.0.0.1:5100", "tcp://127.0.0.1:5101"]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(registered.status(), 200);
        for (n, (rank, zmq)) in [("0", "tcp://127.0.0.1:5100"), ("1", "tcp://127.0.0.1:5101")]
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                chat(&gateway, "r", &mm_request(&[image("a")], false))
                    .await
                    .0,
                200
            );
            let sub = &encoder.requests()[n].body;
            let transfer = sub["ec_transfer_params"]["ec_items"][0]["transfer_id"].clone();
            assert_eq!(sub["ec_transfer_params"]["consumer_zmq"], zmq);
            assert_eq!(transfer.as_str().unwrap().len(), 32);
            let sent = &worker.requests()[n];
            assert_eq!(sent.headers["x-data-parallel-rank"], rank);
            assert_eq!(
                sent.body["ec_transfer_params"]["ec_items"],
                json!([{"mm_hash": sha("http://media/a.png"), "transfer_id": transfer}])
            );
        }
    })
    .await;
}

#[tokio::test]
async fn no_rewrite_forwards_the_original_media_with_the_handles() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let worker = Double::start(Role::Decode, "pd").await;
        let gateway = epd_gateway(&[&encoder], &[], &[], &[&worker], |c| c.no_rewrite = true).await;
        let request = mm_request(&[image("a")], false);
        assert_eq!(chat(&gateway, "raw", &request).await.0, 200);
        // The encoder hashes the raw item itself, as the worker will.
        assert!(encoder.item_batches()[0][0].get("uuid").is_none());
        let sent = worker.only_request().body;
        assert_eq!(sent["messages"], request["messages"]);
        assert_eq!(
            sent["ec_transfer_params"]["e0-hash-http://media/a.png"]["peer_port"],
            7000
        );
    })
    .await;
}

#[tokio::test]
async fn stage_timings_are_exported() {
    bounded(async {
        let encoder = Encoder::start("e0").await;
        let prefill = Double::start(Role::Prefill, "p").await;
        let decode = Double::start(Role::Decode, "d").await;
        let gateway = epd_gateway(&[&encoder], &[&prefill], &[&decode], &[], |_| {}).await;
        assert_eq!(
            chat(&gateway, "m", &mm_request(&[image("a")], false))
                .await
                .0,
            200
        );
        let text = client()
            .get(gateway.at("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for stage in ["encode", "rewrite", "prefill", "decode_ttfb", "total"] {
            let needle = format!("pdserve_gateway_epd_stage_seconds_count{{stage=\"{stage}\"}} 1");
            assert!(text.contains(&needle), "missing {needle}");
        }
        assert!(text.contains("pdserve_gateway_encoder_sub_requests_total 1"));
        assert!(text.contains(r#"pdserve_gateway_disaggregation_total{outcome="e_p_d"} 1"#));
    })
    .await;
}
