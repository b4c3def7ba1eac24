//! The SQLite store's tests: order and pages, whole writes, chains and bounds, files.
use serde_json::json;

use super::*;

fn message(text: &str) -> Value {
    json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
}

fn turn(id: &str, previous: Option<&str>, conversation: Option<&str>, at: i64) -> StoredResponse {
    StoredResponse {
        id: id.into(),
        previous_response_id: previous.map(str::to_string),
        conversation_id: conversation.map(str::to_string),
        created_at: at,
        input: vec![message(id)],
        response: json!({"id": id, "output": [{"id": format!("msg_out_{id}"), "type": "message",
            "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]}),
        kv_route: None,
    }
}

#[test]
fn items_keep_the_order_they_were_added_in_and_page_exactly() {
    let mut store = SqliteStore::in_memory().unwrap();
    let (conv, first) = store
        .create_conversation(&Metadata::new(), vec![message("a"), message("b")], 1)
        .unwrap();
    assert!(first.iter().all(|i| i.id.starts_with("msg_")));
    let more: Vec<Value> = (0..5).map(|i| message(&format!("m{i}"))).collect();
    store.add_items(&conv.id, more, 2).unwrap().unwrap();
    let texts = |page: &ItemPage| -> Vec<String> {
        page.items
            .iter()
            .map(|i| i.body["content"][0]["text"].as_str().unwrap().to_string())
            .collect()
    };
    let asc = |after: Option<String>, limit| ListQuery {
        after,
        limit,
        order: Order::Asc,
    };
    let page = store.list_items(&conv.id, &asc(None, 3)).unwrap().unwrap();
    assert_eq!(
        (texts(&page), page.has_more),
        (vec!["a".into(), "b".into(), "m0".into()], true)
    );
    let last = page.items.last().unwrap().id.clone();
    let page = store
        .list_items(&conv.id, &asc(Some(last), 4))
        .unwrap()
        .unwrap();
    // Exactly the rest: has_more is false on a full last page.
    assert_eq!((texts(&page).len(), page.has_more), (4, false));
    let desc = ListQuery {
        after: None,
        limit: 2,
        order: Order::Desc,
    };
    let page = store.list_items(&conv.id, &desc).unwrap().unwrap();
    assert_eq!(texts(&page), vec!["m4", "m3"]);
    let unknown = asc(Some("msg_nope".into()), 2);
    assert!(matches!(
        store.list_items(&conv.id, &unknown),
        Err(HistoryError::UnknownCursor(_))
    ));
    assert!(store
        .list_items("conv_nope", &asc(None, 2))
        .unwrap()
        .is_none());
}

#[test]
fn a_response_and_its_conversation_items_are_written_together() {
    let mut store = SqliteStore::in_memory().unwrap();
    let (conv, _) = store
        .create_conversation(&Metadata::new(), vec![], 1)
        .unwrap();
    store
        .put_response(&turn("resp_1", None, Some(&conv.id), 2))
        .unwrap();
    let all = ListQuery {
        after: None,
        limit: 100,
        order: Order::Asc,
    };
    let page = store.list_items(&conv.id, &all).unwrap().unwrap();
    assert_eq!(page.items.len(), 2);
    assert_eq!(page.items[1].id, "msg_out_resp_1");
    assert_eq!(page.items[0].response_id.as_deref(), Some("resp_1"));
    // A turn of a conversation that is gone stores nothing.
    assert!(store.delete_conversation(&conv.id).unwrap());
    let orphan = turn("resp_2", Some("resp_1"), Some(&conv.id), 3);
    assert!(matches!(
        store.put_response(&orphan),
        Err(HistoryError::ConversationGone(_))
    ));
    assert!(store.response("resp_2").unwrap().is_none());
    // The same item id twice in one conversation is refused, and nothing of the batch stays.
    let (conv, _) = store
        .create_conversation(&Metadata::new(), vec![], 4)
        .unwrap();
    let dup = vec![
        json!({"id": "msg_x", "type": "message"}),
        json!({"id": "msg_x", "type": "message"}),
    ];
    assert!(matches!(
        store.add_items(&conv.id, dup, 5),
        Err(HistoryError::DuplicateItem(_))
    ));
    assert!(store
        .list_items(&conv.id, &all)
        .unwrap()
        .unwrap()
        .items
        .is_empty());
}

#[test]
fn a_chain_is_walked_oldest_first_and_starts_after_an_expired_turn() {
    let mut store = SqliteStore::in_memory().unwrap();
    store.put_response(&turn("resp_1", None, None, 10)).unwrap();
    store
        .put_response(&turn("resp_2", Some("resp_1"), None, 20))
        .unwrap();
    store
        .put_response(&turn("resp_3", Some("resp_2"), None, 30))
        .unwrap();
    let ids = |chain: Vec<StoredResponse>| chain.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.chain("resp_3").unwrap().unwrap()),
        ["resp_1", "resp_2", "resp_3"]
    );
    assert!(store.chain("resp_9").unwrap().is_none());
    assert_eq!(store.sweep(Some(15), None, None).unwrap(), 1);
    assert_eq!(
        ids(store.chain("resp_3").unwrap().unwrap()),
        ["resp_2", "resp_3"]
    );
    assert_eq!(store.sweep(None, Some(1), None).unwrap(), 1);
    assert_eq!(ids(store.chain("resp_3").unwrap().unwrap()), ["resp_3"]);
}

#[test]
fn a_file_keeps_its_history_and_a_newer_schema_is_refused() {
    let dir = std::env::temp_dir().join(format!("pdserve-history-test-{}", std::process::id()));
    let path = dir.join("history.db");
    {
        let mut store = SqliteStore::open(&path).unwrap();
        store.put_response(&turn("resp_1", None, None, 1)).unwrap();
    }
    let store = SqliteStore::open(&path).unwrap();
    assert!(store.response("resp_1").unwrap().is_some());
    store
        .conn
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    drop(store);
    let refused = SqliteStore::open(&path).err().unwrap();
    assert!(refused.to_string().contains("newer"), "{refused}");
    std::fs::remove_dir_all(&dir).unwrap();
}
