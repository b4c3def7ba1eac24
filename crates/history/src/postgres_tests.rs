//! What only the PostgreSQL store does: migrations across reopening and replicas starting
//! together, replicas appending to one conversation at once, a database that goes away
//! and comes back, and a put_response rate to measure by hand. Every operation's behaviour
//! is tested through the store, against every backend (store_tests.rs).

use std::time::Instant;

use super::sql::SWEEP_LOCK;
use super::*;
use crate::local_postgres::start_for_test;
use crate::store::tests::{all_items, message, options, turn};
use crate::store::{unix_now, HistoryBackend, HistoryStore};

fn open(url: &str, timeout: Duration) -> Result<HistoryStore, HistoryError> {
    let mut options = options(HistoryBackend::Postgres, Some(url.to_string()));
    options.timeout = timeout;
    HistoryStore::open(options)
}

/// A plain connection to `url`, beside the store's pool.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test]
async fn migrations_run_once_and_a_newer_schema_is_refused() {
    let Some(server) = start_for_test("migrations_run_once_and_a_newer_schema_is_refused") else {
        return;
    };
    let url = server.url();
    let store = open(&url, Duration::from_secs(5)).unwrap();
    store
        .put_response(turn("resp_1", None, None, 1))
        .await
        .unwrap();
    drop(store);
    let store = open(&url, Duration::from_secs(5)).unwrap();
    assert!(store.response("resp_1").await.unwrap().is_some());
    let client = connect(&url).await;
    let versions: Vec<i64> = client
        .query("SELECT version FROM pdserve_schema", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(versions, [SCHEMA_VERSION]);
    client
        .execute(
            "UPDATE pdserve_schema SET version = $1",
            &[&(SCHEMA_VERSION + 1)],
        )
        .await
        .unwrap();
    let refused = open(&url, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(refused, HistoryError::NewerSchema { found, known }
            if found == SCHEMA_VERSION + 1 && known == SCHEMA_VERSION),
        "{refused}"
    );
}

#[test]
fn replicas_starting_together_on_an_empty_database_all_open() {
    let Some(server) = start_for_test("replicas_starting_together_on_an_empty_database_all_open")
    else {
        return;
    };
    let url = server.url();
    let opened = std::thread::scope(|scope| {
        let starts: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| open(&url, Duration::from_secs(5)).map(|_| ())))
            .collect();
        starts
            .into_iter()
            .map(|s| s.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(opened.iter().all(Result::is_ok), "{opened:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_appending_to_one_conversation_lose_nothing_and_keep_turns_whole() {
    let test = "two_replicas_appending_to_one_conversation_lose_nothing_and_keep_turns_whole";
    let Some(server) = start_for_test(test) else {
        return;
    };
    let replicas = [
        open(&server.url(), Duration::from_secs(10)).unwrap(),
        open(&server.url(), Duration::from_secs(10)).unwrap(),
    ];
    let (conv, _) = replicas[0]
        .create_conversation(Metadata::new(), vec![])
        .await
        .unwrap();
    const TURNS: usize = 50;
    let appends = replicas.iter().enumerate().map(|(r, store)| {
        let (store, conv) = (store.clone(), conv.id.clone());
        tokio::spawn(async move {
            for t in 0..TURNS {
                let id = format!("resp_{r}_{t:03}");
                store
                    .put_response(turn(&id, None, Some(&conv), unix_now()))
                    .await
                    .unwrap();
            }
        })
    });
    for append in appends.collect::<Vec<_>>() {
        append.await.unwrap();
    }
    let items = all_items(&replicas[1], &conv.id).await;
    assert_eq!(items.len(), 2 * 2 * TURNS);
    // Each turn's two items side by side, input first; each replica's turns in its order.
    let mut last = [None, None];
    for pair in items.chunks(2) {
        let id = pair[0].response_id.clone().unwrap();
        assert_eq!(pair[1].response_id.as_deref(), Some(id.as_str()));
        assert_eq!(pair[0].body["content"], message(&id)["content"]);
        assert_eq!(pair[1].id, format!("msg_out_{id}"));
        let replica: usize = id[5..6].parse().unwrap();
        assert!(last[replica].as_ref() < Some(&id), "{id} after {last:?}");
        last[replica] = Some(id);
    }
}

/// Runs `call` until it succeeds, for at most `within`; how long it took.
async fn until_ok<F, Fut, T>(within: Duration, mut call: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, HistoryError>>,
{
    let start = Instant::now();
    loop {
        match call().await {
            Ok(_) => return start.elapsed(),
            Err(e) if start.elapsed() > within => panic!("still failing after {within:?}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test]
async fn a_stopped_database_is_unavailable_within_the_timeout_and_then_comes_back() {
    let test = "a_stopped_database_is_unavailable_within_the_timeout_and_then_comes_back";
    let Some(mut server) = start_for_test(test) else {
        return;
    };
    let timeout = Duration::from_millis(500);
    let store = open(&server.url(), timeout).unwrap();
    let (conv, _) = store
        .create_conversation(Metadata::new(), vec![message("a")])
        .await
        .unwrap();
    // Fill the pool with several connections, all of which the stop will cut.
    let reads = (0..4).map(|_| store.conversation(&conv.id));
    for read in futures::future::join_all(reads).await {
        assert!(read.unwrap().is_some());
    }
    server.stop().unwrap();
    for _ in 0..3 {
        let start = Instant::now();
        let err = store
            .put_response(turn("resp_down", None, Some(&conv.id), 1))
            .await
            .unwrap_err();
        assert!(matches!(err, HistoryError::Unavailable(_)), "{err}");
        assert!(start.elapsed() < timeout + Duration::from_millis(300));
        let err = store.conversation(&conv.id).await.unwrap_err();
        assert!(matches!(err, HistoryError::Unavailable(_)), "{err}");
    }
    server.start_again().unwrap();
    let back = until_ok(Duration::from_secs(5), || store.conversation(&conv.id)).await;
    eprintln!("the store answered {back:?} after the database came back");
    // Every pooled connection works again, not only the first one handed out.
    let turns =
        (0..4).map(|i| store.put_response(turn(&format!("resp_{i}"), None, Some(&conv.id), 1)));
    for put in futures::future::join_all(turns).await {
        put.unwrap();
    }
    assert_eq!(all_items(&store, &conv.id).await.len(), 1 + 4 * 2);
    assert!(store.response("resp_down").await.unwrap().is_none());
}

#[tokio::test]
async fn a_call_stuck_behind_a_lock_times_out_and_its_connection_is_not_reused() {
    let test = "a_call_stuck_behind_a_lock_times_out_and_its_connection_is_not_reused";
    let Some(server) = start_for_test(test) else {
        return;
    };
    let timeout = Duration::from_millis(300);
    let store = open(&server.url(), timeout).unwrap();
    let (conv, _) = store
        .create_conversation(Metadata::new(), vec![])
        .await
        .unwrap();
    let (other, _) = store
        .create_conversation(Metadata::new(), vec![])
        .await
        .unwrap();
    // Another client holds the conversation's lock, as a stuck replica would.
    let mut holder = connect(&server.url()).await;
    let held = holder.transaction().await.unwrap();
    held.execute(
        "SELECT 1 FROM conversations WHERE id = $1 FOR UPDATE",
        &[&conv.id],
    )
    .await
    .unwrap();
    let start = Instant::now();
    let err = store
        .add_items(&conv.id, vec![message("blocked")])
        .await
        .unwrap_err();
    assert!(matches!(err, HistoryError::Unavailable(_)), "{err}");
    assert!(start.elapsed() < timeout + Duration::from_millis(300));
    // The pool's only connection was the stuck one: had it gone back to the pool, this
    // call would queue behind the stuck query and time out too.
    store
        .add_items(&other.id, vec![message("elsewhere")])
        .await
        .unwrap()
        .unwrap();
    held.rollback().await.unwrap();
    store
        .add_items(&conv.id, vec![message("after")])
        .await
        .unwrap()
        .unwrap();
    let items = all_items(&store, &conv.id).await;
    let texts: Vec<_> = items
        .iter()
        .map(|i| i.body["content"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["after"]);
}

#[tokio::test]
async fn a_sweep_while_another_replica_sweeps_deletes_nothing() {
    let test = "a_sweep_while_another_replica_sweeps_deletes_nothing";
    let Some(server) = start_for_test(test) else {
        return;
    };
    let store = open(&server.url(), Duration::from_secs(5)).unwrap();
    store
        .put_response(turn("resp_old", None, None, 1))
        .await
        .unwrap();
    // The other replica's sweep, holding the sweep lock.
    let mut other = connect(&server.url()).await;
    let sweeping = other.transaction().await.unwrap();
    sweeping
        .execute("SELECT pg_advisory_xact_lock($1)", &[&SWEEP_LOCK])
        .await
        .unwrap();
    assert_eq!(store.sweep_with(Some(10), None, None).await.unwrap(), 0);
    assert!(store.response("resp_old").await.unwrap().is_some());
    sweeping.commit().await.unwrap();
    assert_eq!(store.sweep_with(Some(10), None, None).await.unwrap(), 1);
}

#[tokio::test]
async fn an_unreachable_database_at_start_is_an_open_error_naming_the_url() {
    // A port nothing listens on (bound a moment ago, then let go).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://pdserve:secret@127.0.0.1:{port}/history");
    let start = Instant::now();
    let err = open(&url, Duration::from_secs(2)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(12));
    let text = err.to_string();
    assert!(matches!(err, HistoryError::Open { .. }), "{text}");
    assert!(
        text.contains(&format!("pdserve:***@127.0.0.1:{port}/history")),
        "{text}"
    );
    assert!(!text.contains("secret"), "{text}");
    let bad = open("postgres://127.0.0.1:notaport/db", Duration::from_secs(1)).unwrap_err();
    assert!(matches!(bad, HistoryError::Open { .. }), "{bad}");
}

#[test]
fn a_password_never_shows_in_a_url() {
    assert_eq!(
        redact("postgres://u:p@ss@h:5432/db?x=1"),
        "postgres://u:***@h:5432/db?x=1"
    );
    assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    assert_eq!(redact("host=h user=u"), "host=h user=u");
    let options = options(
        HistoryBackend::Postgres,
        Some("postgres://u:hunter2@h/db".into()),
    );
    let shown = format!("{options:?}");
    assert!(
        shown.contains("u:***@h") && !shown.contains("hunter2"),
        "{shown}"
    );
}

/// Turns stored per second by `callers` tasks on each of `replicas`, each task appending
/// `per_caller` turns (two items each) to a conversation of its own index (so replicas
/// contend for the same conversations' locks).
async fn put_response_rate(replicas: &[HistoryStore], callers: usize, per_caller: usize) -> f64 {
    let mut convs = Vec::new();
    for _ in 0..callers {
        let (conv, _) = replicas[0]
            .create_conversation(Metadata::new(), vec![])
            .await
            .unwrap();
        convs.push(conv.id);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (r, store) in replicas.iter().enumerate() {
        for (t, conv) in convs.iter().enumerate() {
            let (store, conv) = (store.clone(), conv.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..per_caller {
                    let id = crate::records::new_id(&format!("resp_{r}_{t}_{i}"));
                    store
                        .put_response(turn(&id, None, Some(&conv), unix_now()))
                        .await
                        .unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    (replicas.len() * callers * per_caller) as f64 / start.elapsed().as_secs_f64()
}

/// put_response per second from one store and from two on one database, with one caller
/// and with 8 per store; SQLite's (a file) beside it. Run by hand:
/// `cargo test -p pdserve-history -- --ignored --nocapture put_response_per_second`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn put_response_per_second() {
    let Some(server) = start_for_test("put_response_per_second") else {
        return;
    };
    let pg = |_| open(&server.url(), Duration::from_secs(10)).unwrap();
    for (stores, callers, per_caller) in [(1, 1, 1000), (1, 8, 250), (2, 1, 1000), (2, 8, 250)] {
        let replicas: Vec<_> = (0..stores).map(pg).collect();
        let rate = put_response_rate(&replicas, callers, per_caller).await;
        eprintln!("PostgreSQL: {stores} store(s) x {callers} caller(s): {rate:.0} put_response/s");
    }
    let file = std::env::temp_dir().join(format!("pdserve-rate-{}.db", std::process::id()));
    let url = Some(file.display().to_string());
    let sqlite = HistoryStore::open(options(HistoryBackend::Sqlite, url)).unwrap();
    for callers in [1, 8] {
        let rate = put_response_rate(std::slice::from_ref(&sqlite), callers, 2000 / callers).await;
        eprintln!("SQLite file: 1 store x {callers} caller(s): {rate:.0} put_response/s");
    }
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
    }
}
