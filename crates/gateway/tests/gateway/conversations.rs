//! The Conversations API (`/v1/conversations`) on the history store: every route, the
//! list's order and pages, OpenAI's limits and errors, a SQLite file that outlives the
//! gateway, and `--history-backend none`.

use pdserve_gateway::GatewayConfig;
use pdserve_history::HistoryBackend;
use serde_json::{json, Value};

use crate::double::{Double, Role};
use crate::{bounded, client, urls, Gateway};

async fn gateway(backend: HistoryBackend, url: Option<String>) -> (Double, Gateway) {
    let w = Double::start(Role::Decode, "W").await;
    let mut config = GatewayConfig::new(Vec::new(), Vec::new(), urls(&[&w]));
    config.history.backend = backend;
    config.history.url = url;
    config.max_body_bytes = 1 << 20;
    (w, Gateway::start(config).await)
}

/// `method path` with `body` on `gw`: (status, JSON answer).
async fn call(gw: &Gateway, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let http = client();
    let url = gw.at(path);
    let request = match method {
        "GET" => http.get(url),
        "DELETE" => http.delete(url),
        _ => http.post(url),
    };
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn texts(list: &Value) -> Vec<String> {
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            i["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn every_route_answers_as_openai_does() {
    bounded(async {
        let (_w, gw) = gateway(HistoryBackend::Memory, None).await;
        let (status, conv) = call(
            &gw,
            "POST",
            "/v1/conversations",
            Some(json!({"metadata": {"topic": "demo"},
                        "items": [{"type": "message", "role": "user", "content": "first"}]})),
        )
        .await;
        assert_eq!(status, 200, "{conv}");
        let id = conv["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("conv_"), "{conv}");
        assert_eq!(
            (conv["object"].as_str(), conv["metadata"]["topic"].as_str()),
            (Some("conversation"), Some("demo"))
        );
        assert!(conv["created_at"].as_i64().unwrap() > 1_700_000_000);
        let (status, got) = call(&gw, "GET", &format!("/v1/conversations/{id}"), None).await;
        assert_eq!((status, &got), (200, &conv));

        // Items keep the order they were added in; the list runs newest first by default.
        let more: Vec<Value> = (1..=4)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect();
        let (status, added) = call(
            &gw,
            "POST",
            &format!("/v1/conversations/{id}/items"),
            Some(json!({"items": more})),
        )
        .await;
        assert_eq!(status, 200, "{added}");
        assert_eq!(texts(&added), ["m1", "m2", "m3", "m4"]);
        assert_eq!(added["object"], "list");
        assert_eq!(added["data"][0]["content"][0]["type"], "input_text");
        let items = format!("/v1/conversations/{id}/items");
        let (_, page) = call(&gw, "GET", &format!("{items}?limit=2"), None).await;
        assert_eq!(
            (texts(&page), page["has_more"].as_bool()),
            (vec!["m4".into(), "m3".into()], Some(true))
        );
        let after = page["last_id"].as_str().unwrap();
        let (_, page) = call(&gw, "GET", &format!("{items}?limit=3&after={after}"), None).await;
        assert_eq!(
            (texts(&page), page["has_more"].as_bool()),
            (vec!["m2".into(), "m1".into(), "first".into()], Some(false))
        );
        let (_, page) = call(&gw, "GET", &format!("{items}?order=asc&limit=100"), None).await;
        assert_eq!(texts(&page), ["first", "m1", "m2", "m3", "m4"]);

        // One item; delete it (the answer is the conversation).
        let item_id = page["data"][1]["id"].as_str().unwrap().to_string();
        assert!(item_id.starts_with("msg_"));
        let (status, item) = call(&gw, "GET", &format!("{items}/{item_id}"), None).await;
        assert_eq!((status, item["id"].as_str()), (200, Some(item_id.as_str())));
        let (status, after_delete) = call(&gw, "DELETE", &format!("{items}/{item_id}"), None).await;
        assert_eq!(
            (status, after_delete["id"].as_str()),
            (200, Some(id.as_str()))
        );
        let (status, missing) = call(&gw, "GET", &format!("{items}/{item_id}"), None).await;
        assert_eq!(status, 404, "{missing}");
        assert!(missing["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&item_id));

        // Metadata is replaced.
        let (status, updated) = call(
            &gw,
            "POST",
            &format!("/v1/conversations/{id}"),
            Some(json!({"metadata": {"stage": "two"}})),
        )
        .await;
        assert_eq!(
            (status, &updated["metadata"]),
            (200, &json!({"stage": "two"}))
        );

        // Deleted, then unknown.
        let (status, deleted) = call(&gw, "DELETE", &format!("/v1/conversations/{id}"), None).await;
        assert_eq!(
            (status, deleted),
            (
                200,
                json!({"id": id, "object": "conversation.deleted", "deleted": true})
            )
        );
        for (method, path) in [
            ("GET", format!("/v1/conversations/{id}")),
            ("DELETE", format!("/v1/conversations/{id}")),
            ("GET", items.clone()),
            ("POST", format!("/v1/conversations/{id}")),
        ] {
            let body = (method == "POST").then(|| json!({"metadata": {}}));
            let (status, error) = call(&gw, method, &path, body).await;
            assert_eq!(status, 404, "{method} {path}: {error}");
            let message = error["error"]["message"].as_str().unwrap_or_default();
            assert!(
                message.contains(&id) && message.contains("not found"),
                "{error}"
            );
        }
    })
    .await;
}

#[tokio::test]
async fn bad_input_gets_a_400_that_names_the_parameter() {
    bounded(async {
        let (_w, gw) = gateway(HistoryBackend::Memory, None).await;
        let (_, conv) = call(&gw, "POST", "/v1/conversations", Some(json!({}))).await;
        let id = conv["id"].as_str().unwrap();
        let items = format!("/v1/conversations/{id}/items");
        let too_many = Value::Array(vec![json!({"role": "user", "content": "x"}); 21]);
        let long_key = json!({"k".repeat(65): "v"});
        for (method, path, body, param) in [
            (
                "POST",
                "/v1/conversations".to_string(),
                json!({"metadata": {"n": 1}}),
                "metadata",
            ),
            (
                "POST",
                "/v1/conversations".to_string(),
                json!({"metadata": long_key}),
                "metadata",
            ),
            (
                "POST",
                "/v1/conversations".to_string(),
                json!({"items": too_many}),
                "items",
            ),
            ("POST", items.clone(), json!({}), "items"),
            (
                "POST",
                items.clone(),
                json!({"items": [{"type": "message", "content": "no role"}]}),
                "items[0].role",
            ),
            (
                "POST",
                format!("/v1/conversations/{id}"),
                json!({}),
                "metadata",
            ),
        ] {
            let (status, error) = call(&gw, method, &path, Some(body.clone())).await;
            assert_eq!(status, 400, "{body}: {error}");
            assert_eq!(error["error"]["param"], param, "{body}: {error}");
        }
        for (query, param) in [
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("order=up", "order"),
            ("after=msg_nope", "after"),
        ] {
            let (status, error) = call(&gw, "GET", &format!("{items}?{query}"), None).await;
            assert_eq!(
                (status, error["error"]["param"].as_str()),
                (400, Some(param)),
                "{query}: {error}"
            );
        }
        // An item id already in the conversation.
        let dup = json!({"items": [{"id": "msg_same", "role": "user", "content": "a"}]});
        assert_eq!(call(&gw, "POST", &items, Some(dup.clone())).await.0, 200);
        assert_eq!(call(&gw, "POST", &items, Some(dup)).await.0, 400);
        // Not JSON.
        let response = client()
            .post(gw.at("/v1/conversations"))
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        // Over --max-body-bytes: 413, for conversations and for Responses alike.
        let huge = json!({"items": [{"role": "user", "content": "x".repeat(5 << 20)}]});
        for path in ["/v1/conversations", items.as_str()] {
            let (status, error) = call(&gw, "POST", path, Some(huge.clone())).await;
            assert_eq!(status, 413, "{path}: {error}");
        }
        let huge_turn = json!({"input": "x".repeat(5 << 20), "conversation": id});
        let (status, error) = call(&gw, "POST", "/v1/responses", Some(huge_turn)).await;
        assert_eq!(status, 413, "{error}");
        // A turn of a conversation that does not exist, and both ways of continuing.
        let (status, error) = call(
            &gw,
            "POST",
            "/v1/responses",
            Some(json!({"input": "hi", "conversation": "conv_nope"})),
        )
        .await;
        assert_eq!(
            (status, error["error"]["param"].as_str()),
            (404, Some("conversation"))
        );
        let (status, error) = call(
            &gw,
            "POST",
            "/v1/responses",
            Some(json!({"input": "hi", "conversation": id, "previous_response_id": "resp_1"})),
        )
        .await;
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["error"]["code"], "mutually_exclusive_parameters");
    })
    .await;
}

#[tokio::test]
async fn a_sqlite_file_outlives_the_gateway_and_none_keeps_nothing() {
    bounded(async {
        let dir = std::env::temp_dir().join(format!("pdserve-conv-test-{}", std::process::id()));
        let file = dir.join("history.db").display().to_string();
        let (w, gw) = gateway(HistoryBackend::Sqlite, Some(file.clone())).await;
        let (_, conv) = call(
            &gw,
            "POST",
            "/v1/conversations",
            Some(json!({"items": [{"role": "user", "content": "kept"}]})),
        )
        .await;
        let id = conv["id"].as_str().unwrap().to_string();
        drop(gw);
        drop(w);
        let (_w, gw) = gateway(HistoryBackend::Sqlite, Some(file)).await;
        let (status, page) = call(&gw, "GET", &format!("/v1/conversations/{id}/items"), None).await;
        assert_eq!((status, texts(&page)), (200, vec!["kept".to_string()]));
        drop(gw);
        std::fs::remove_dir_all(&dir).unwrap();

        let (_w, gw) = gateway(HistoryBackend::None, None).await;
        let (status, error) = call(&gw, "POST", "/v1/conversations", Some(json!({}))).await;
        assert_eq!(status, 503, "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("history"),
            "{error}"
        );
    })
    .await;
}
