//! The SQLite store's own tests: a file across reopening, and its schema version. What
//! every backend does is tested through the store (store_tests.rs), SQLite included.

use super::*;
use crate::store::tests::turn;

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
