//! [`HistoryStore`]'s tests: one body per behaviour, run against every backend (memory, a
//! SQLite file, PostgreSQL on a [`LocalPostgres`] of its own), then what only the store
//! itself does (no backend, the timeout).

use serde_json::json;

use super::*;
use crate::local_postgres::start_for_test;
use crate::records::Order;

pub(crate) fn options(backend: HistoryBackend, url: Option<String>) -> HistoryOptions {
    HistoryOptions {
        backend,
        url,
        retention: Duration::ZERO,
        max_responses: 1000,
        max_conversations: 1000,
        timeout: Duration::from_secs(5),
    }
}

pub(crate) fn message(text: &str) -> Value {
    json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
}

/// A turn: one input item (`id`'s text) and one output item (`msg_out_<id>`).
pub(crate) fn turn(
    id: &str,
    previous: Option<&str>,
    conversation: Option<&str>,
    at: i64,
) -> StoredResponse {
    StoredResponse {
        id: id.into(),
        previous_response_id: previous.map(str::to_string),
        conversation_id: conversation.map(str::to_string),
        created_at: at,
        input: vec![message(id)],
        response: json!({"id": id, "output": [{"id": format!("msg_out_{id}"), "type": "message",
            "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]}),
        kv_route: Some(json!({"worker": "http://127.0.0.1:1", "handle": id})),
    }
}

fn query(after: Option<String>, limit: usize, order: Order) -> ListQuery {
    ListQuery {
        after,
        limit,
        order,
    }
}

/// Every item of conversation `id`, oldest first.
pub(crate) async fn all_items(store: &HistoryStore, id: &str) -> Vec<Item> {
    let mut items = Vec::new();
    loop {
        let after = items.last().map(|i: &Item| i.id.clone());
        let page = store
            .list_items(id, query(after, 100, Order::Asc))
            .await
            .unwrap()
            .unwrap();
        items.extend(page.items);
        if !page.has_more {
            return items;
        }
    }
}

/// Runs every body, each on a fresh store that `open` makes (given the body's name).
async fn every_body(mut open: impl FnMut(&str) -> HistoryStore) {
    items_keep_the_order_they_were_added_in_and_page_exactly(open("order")).await;
    a_response_and_its_conversation_items_are_written_together(open("whole")).await;
    a_chain_is_walked_oldest_first_and_starts_after_an_expired_turn(open("chain")).await;
    conversations_and_items_are_read_updated_and_deleted(open("crud")).await;
    the_size_and_age_bounds_delete_the_oldest(open("bounds")).await;
}

#[tokio::test]
async fn every_operation_in_memory() {
    every_body(|_| HistoryStore::open(options(HistoryBackend::Memory, None)).unwrap()).await;
}

#[tokio::test]
async fn every_operation_in_a_sqlite_file() {
    let dir = std::env::temp_dir().join(format!("pdserve-history-store-{}", std::process::id()));
    every_body(|name| {
        let url = dir.join(format!("{name}.db")).display().to_string();
        HistoryStore::open(options(HistoryBackend::Sqlite, Some(url))).unwrap()
    })
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn every_operation_in_postgres() {
    let Some(server) = start_for_test("every_operation_in_postgres") else {
        return;
    };
    every_body(|name| {
        let url = server.create_database(name).unwrap();
        HistoryStore::open(options(HistoryBackend::Postgres, Some(url))).unwrap()
    })
    .await;
}

async fn items_keep_the_order_they_were_added_in_and_page_exactly(store: HistoryStore) {
    let (conv, first) = store
        .create_conversation(Metadata::new(), vec![message("a"), message("b")])
        .await
        .unwrap();
    assert!(first.iter().all(|i| i.id.starts_with("msg_")));
    let more: Vec<Value> = (0..5).map(|i| message(&format!("m{i}"))).collect();
    store.add_items(&conv.id, more).await.unwrap().unwrap();
    let texts = |page: &ItemPage| -> Vec<String> {
        page.items
            .iter()
            .map(|i| i.body["content"][0]["text"].as_str().unwrap().to_string())
            .collect()
    };
    let page = store
        .list_items(&conv.id, query(None, 3, Order::Asc))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (texts(&page), page.has_more),
        (vec!["a".into(), "b".into(), "m0".into()], true)
    );
    let last = page.items.last().unwrap().id.clone();
    let page = store
        .list_items(&conv.id, query(Some(last), 4, Order::Asc))
        .await
        .unwrap()
        .unwrap();
    // Exactly the rest: has_more is false on a full last page.
    assert_eq!((texts(&page).len(), page.has_more), (4, false));
    let page = store
        .list_items(&conv.id, query(None, 2, Order::Desc))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(texts(&page), vec!["m4", "m3"]);
    let after = page.items[1].id.clone();
    let page = store
        .list_items(&conv.id, query(Some(after), 2, Order::Desc))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (texts(&page), page.has_more),
        (vec!["m2".into(), "m1".into()], true)
    );
    let unknown = query(Some("msg_nope".into()), 2, Order::Asc);
    assert!(matches!(
        store.list_items(&conv.id, unknown).await,
        Err(HistoryError::UnknownCursor(_))
    ));
    assert!(store
        .list_items("conv_nope", query(None, 2, Order::Asc))
        .await
        .unwrap()
        .is_none());
    assert!(store
        .add_items("conv_nope", vec![message("x")])
        .await
        .unwrap()
        .is_none());
}

async fn a_response_and_its_conversation_items_are_written_together(store: HistoryStore) {
    let (conv, _) = store
        .create_conversation(Metadata::new(), vec![])
        .await
        .unwrap();
    let first = turn("resp_1", None, Some(&conv.id), 2);
    store.put_response(first.clone()).await.unwrap();
    assert_eq!(store.response("resp_1").await.unwrap(), Some(first));
    let items = all_items(&store, &conv.id).await;
    assert_eq!(items.len(), 2);
    assert_eq!(items[1].id, "msg_out_resp_1");
    assert_eq!(items[0].response_id.as_deref(), Some("resp_1"));
    // A turn whose item is already in the conversation stores nothing, response included.
    let mut clash = turn("resp_2", Some("resp_1"), Some(&conv.id), 3);
    clash.response["output"][0]["id"] = json!("msg_out_resp_1");
    assert!(matches!(
        store.put_response(clash).await,
        Err(HistoryError::DuplicateItem(id)) if id == "msg_out_resp_1"
    ));
    assert!(store.response("resp_2").await.unwrap().is_none());
    assert_eq!(all_items(&store, &conv.id).await.len(), 2);
    // A turn of a conversation that is gone stores nothing.
    assert!(store.delete_conversation(&conv.id).await.unwrap());
    let orphan = turn("resp_3", Some("resp_1"), Some(&conv.id), 3);
    assert!(matches!(
        store.put_response(orphan).await,
        Err(HistoryError::ConversationGone(_))
    ));
    assert!(store.response("resp_3").await.unwrap().is_none());
    // The same item id twice in one conversation is refused, and nothing of the batch stays.
    let (conv, _) = store
        .create_conversation(Metadata::new(), vec![])
        .await
        .unwrap();
    let dup = vec![
        json!({"id": "msg_x", "type": "message"}),
        json!({"id": "msg_x", "type": "message"}),
    ];
    assert!(matches!(
        store.add_items(&conv.id, dup).await,
        Err(HistoryError::DuplicateItem(_))
    ));
    assert!(all_items(&store, &conv.id).await.is_empty());
}

async fn a_chain_is_walked_oldest_first_and_starts_after_an_expired_turn(store: HistoryStore) {
    store
        .put_response(turn("resp_1", None, None, 10))
        .await
        .unwrap();
    store
        .put_response(turn("resp_2", Some("resp_1"), None, 20))
        .await
        .unwrap();
    store
        .put_response(turn("resp_3", Some("resp_2"), None, 30))
        .await
        .unwrap();
    let ids = |chain: Vec<StoredResponse>| chain.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.chain("resp_3").await.unwrap().unwrap()),
        ["resp_1", "resp_2", "resp_3"]
    );
    assert!(store.chain("resp_9").await.unwrap().is_none());
    assert_eq!(store.sweep_with(Some(15), None, None).await.unwrap(), 1);
    assert_eq!(
        ids(store.chain("resp_3").await.unwrap().unwrap()),
        ["resp_2", "resp_3"]
    );
    assert_eq!(store.sweep_with(None, Some(1), None).await.unwrap(), 1);
    assert_eq!(
        ids(store.chain("resp_3").await.unwrap().unwrap()),
        ["resp_3"]
    );
    // A cycle (which no gateway writes) is walked at most MAX_CHAIN deep, not forever.
    store
        .put_response(turn("resp_a", Some("resp_b"), None, 40))
        .await
        .unwrap();
    store
        .put_response(turn("resp_b", Some("resp_a"), None, 40))
        .await
        .unwrap();
    let cycle = store.chain("resp_a").await.unwrap().unwrap();
    assert_eq!(cycle.len(), crate::sqlite::MAX_CHAIN);
}

async fn conversations_and_items_are_read_updated_and_deleted(store: HistoryStore) {
    let mut metadata = Metadata::new();
    metadata.insert("topic".into(), "tests".into());
    let given = json!({"id": "msg_given", "type": "message", "role": "user", "content": "hi"});
    let (conv, items) = store
        .create_conversation(metadata.clone(), vec![given.clone()])
        .await
        .unwrap();
    assert!(conv.id.starts_with("conv_") && conv.created_at > 0);
    assert_eq!(items[0].body, given);
    let read = store.conversation(&conv.id).await.unwrap().unwrap();
    assert_eq!(read, conv);
    metadata.insert("topic".into(), "changed".into());
    let updated = store
        .update_conversation(&conv.id, metadata.clone())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(updated.metadata, metadata);
    assert_eq!(updated.created_at, conv.created_at);
    assert_eq!(store.conversation(&conv.id).await.unwrap(), Some(updated));
    assert!(store
        .update_conversation("conv_nope", metadata)
        .await
        .unwrap()
        .is_none());
    // Items come back exactly as added, key order included.
    let item = store.item(&conv.id, "msg_given").await.unwrap().unwrap();
    assert_eq!(
        serde_json::to_string(&item.body).unwrap(),
        serde_json::to_string(&given).unwrap()
    );
    assert!(store
        .item("conv_nope", "msg_given")
        .await
        .unwrap()
        .is_none());
    assert!(store.delete_item(&conv.id, "msg_given").await.unwrap());
    assert!(!store.delete_item(&conv.id, "msg_given").await.unwrap());
    assert!(store.item(&conv.id, "msg_given").await.unwrap().is_none());
    store
        .put_response(turn("resp_1", None, Some(&conv.id), 5))
        .await
        .unwrap();
    // Deleting a response leaves the items its turn added.
    assert!(store.delete_response("resp_1").await.unwrap());
    assert!(!store.delete_response("resp_1").await.unwrap());
    assert!(store.response("resp_1").await.unwrap().is_none());
    assert_eq!(all_items(&store, &conv.id).await.len(), 2);
    // Deleting a conversation takes its items with it.
    assert!(store.delete_conversation(&conv.id).await.unwrap());
    assert!(!store.delete_conversation(&conv.id).await.unwrap());
    assert!(store.conversation(&conv.id).await.unwrap().is_none());
    assert!(store
        .item(&conv.id, "msg_out_resp_1")
        .await
        .unwrap()
        .is_none());
}

async fn the_size_and_age_bounds_delete_the_oldest(store: HistoryStore) {
    let now = unix_now();
    let (mut convs, mut first_items) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (conv, items) = store
            .create_conversation(Metadata::new(), vec![message("x")])
            .await
            .unwrap();
        convs.push(conv.id);
        first_items.push(items[0].id.clone());
    }
    // Created in the same second: the first created goes first, with its items.
    assert_eq!(store.sweep_with(None, None, Some(2)).await.unwrap(), 1);
    assert!(store.conversation(&convs[0]).await.unwrap().is_none());
    assert!(store
        .item(&convs[0], &first_items[0])
        .await
        .unwrap()
        .is_none());
    assert!(store.conversation(&convs[1]).await.unwrap().is_some());
    // Past retention: a conversation goes unless an item of it is recent.
    store
        .put_response(turn("resp_new", None, Some(&convs[2]), now + 100))
        .await
        .unwrap();
    store
        .put_response(turn("resp_old", None, None, now - 100))
        .await
        .unwrap();
    // resp_old, and convs[1] (its only item is older than the bound).
    assert_eq!(
        store.sweep_with(Some(now + 50), None, None).await.unwrap(),
        2
    );
    assert!(store.conversation(&convs[1]).await.unwrap().is_none());
    assert!(store.conversation(&convs[2]).await.unwrap().is_some());
    assert!(store.response("resp_new").await.unwrap().is_some());
    assert!(store.response("resp_old").await.unwrap().is_none());
    // Most responses: the newest stay.
    for i in 0..4 {
        store
            .put_response(turn(&format!("resp_{i}"), None, None, now + i))
            .await
            .unwrap();
    }
    assert_eq!(store.sweep_with(None, Some(2), None).await.unwrap(), 3);
    assert!(store.response("resp_3").await.unwrap().is_some());
    assert!(store.response("resp_new").await.unwrap().is_some());
    assert!(store.response("resp_2").await.unwrap().is_none());
    // The options' bounds are the ones sweep uses.
    assert_eq!(store.sweep().await.unwrap(), 0);
}

#[test]
fn the_stores_calls_can_cross_threads() {
    fn send<T: Send>(_: &T) {}
    let store = HistoryStore::open(options(HistoryBackend::Memory, None)).unwrap();
    send(&store.put_response(turn("resp_1", None, None, 1)));
    send(&store.list_items("conv_1", query(None, 1, Order::Asc)));
    send(&store.sweep());
}

#[tokio::test]
async fn no_backend_is_unavailable_and_sqlite_needs_a_path() {
    let none = HistoryStore::open(options(HistoryBackend::None, None)).unwrap();
    assert!(!none.enabled());
    let refused = none.response("resp_1").await.unwrap_err();
    assert!(
        refused.to_string().contains("--history-backend none"),
        "{refused}"
    );
    for backend in [HistoryBackend::Sqlite, HistoryBackend::Postgres] {
        let missing = HistoryStore::open(options(backend, None)).err().unwrap();
        assert!(missing.to_string().contains("--history-url"), "{missing}");
    }
}

#[tokio::test]
async fn a_call_that_outlives_the_timeout_is_unavailable_not_a_hang() {
    let mut slow = options(HistoryBackend::Memory, None);
    slow.timeout = Duration::from_millis(50);
    let store = HistoryStore::open(slow).unwrap();
    // Hold the database, as a stuck call would.
    let Some(Backend::Sqlite(db)) = store.db.clone() else {
        panic!("the memory backend is SQLite");
    };
    let held = std::thread::spawn(move || {
        let _guard = db.lock().unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    std::thread::sleep(Duration::from_millis(20));
    let err = store.response("resp_1").await.unwrap_err();
    assert!(matches!(err, HistoryError::Unavailable(_)), "{err}");
    held.join().unwrap();
    // Once free again, it answers.
    assert!(store.response("resp_1").await.unwrap().is_none());
}
