//! A stand-in Kubernetes API server: pod list and watch for one namespace with real
//! Kubernetes JSON — resourceVersions, label selectors (a pod that stops matching is sent
//! to that watch as DELETED, as the API server's watch cache does), bookmarks, 410 Gone
//! for a resourceVersion older than the retained history, and watch connections the test
//! can cut mid-stream.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};

/// One change to a pod, as history keeps it.
#[derive(Clone, Debug)]
struct Change {
    version: u64,
    before: Option<Value>,
    after: Option<Value>,
}

#[derive(Default)]
struct Store {
    version: u64,
    /// Pods by name (their JSON, resourceVersion included).
    pods: BTreeMap<String, Value>,
    history: Vec<Change>,
    /// Watches from a resourceVersion below this get 410 Gone (a list gives the current
    /// version, which may be watched from).
    oldest_watchable: u64,
}

struct Shared {
    namespace: String,
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Bumped to cut every open watch connection.
    cuts: watch::Sender<u64>,
    /// Requests served, as `list` or `watch` (and the query), in order.
    log: Mutex<Vec<String>>,
}

/// The stand-in, serving on 127.0.0.1 until dropped.
pub struct KubeApi {
    pub url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
    /// The kubeconfig files written for this server, removed with it.
    kubeconfigs: Mutex<Vec<std::path::PathBuf>>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.task.abort();
        let files = self
            .kubeconfigs
            .get_mut()
            .unwrap_or_else(|e| e.into_inner());
        for path in files.drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A pod JSON object as the API server returns it.
pub fn pod(name: &str, uid: &str, labels: Value, port: u16, ready: bool) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": labels,
            "annotations": {"pdserve.dev/port": port.to_string()},
            "creationTimestamp": "2026-12-02T10:00:00Z"
        },
        "spec": {"containers": [{"name": "worker", "image": "pdserve:latest"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}
            ]
        }
    })
}

impl KubeApi {
    pub async fn start(namespace: &str) -> Self {
        let shared = Arc::new(Shared {
            namespace: namespace.to_string(),
            store: Mutex::new(Store::default()),
            changes: broadcast::channel(1024).0,
            cuts: watch::channel(0).0,
            log: Mutex::new(Vec::new()),
        });
        let app = Router::new()
            .route("/api/v1/namespaces/{namespace}/pods", get(pods))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        // As Go's API server does: no Nagle delay between a watch's small event lines.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            shared,
            task,
            kubeconfigs: Mutex::default(),
        }
    }

    /// A kubeconfig file naming this server, in the temporary directory (removed when
    /// the server is dropped).
    pub fn kubeconfig(&self, name: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "pdserve-kubeconfig-{name}-{}.yaml",
            std::process::id()
        ));
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: {}\n\
                 users:\n- name: tester\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    cluster: stand-in\n    user: tester\n\
                 current-context: test\n",
                self.url
            ),
        )
        .unwrap();
        self.kubeconfigs.lock().unwrap().push(path.clone());
        path
    }

    /// Creates or replaces a pod (its metadata.name is the key); returns when watchers
    /// were told.
    pub fn put(&self, mut pod: Value) -> Instant {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        let mut store = self.shared.store.lock().unwrap();
        store.version += 1;
        let version = store.version;
        pod["metadata"]["resourceVersion"] = json!(version.to_string());
        pod["metadata"]["namespace"] = json!(self.shared.namespace);
        let before = store.pods.insert(name, pod.clone());
        self.record(&mut store, before, Some(pod))
    }

    /// Edits a stored pod with `edit`, as a controller's update would.
    pub fn update(&self, name: &str, edit: impl FnOnce(&mut Value)) -> Instant {
        let mut pod = self.shared.store.lock().unwrap().pods[name].clone();
        edit(&mut pod);
        self.put(pod)
    }

    /// Deletes a pod, telling watchers.
    pub fn delete(&self, name: &str) -> Instant {
        let mut store = self.shared.store.lock().unwrap();
        store.version += 1;
        let Some(mut before) = store.pods.remove(name) else {
            panic!("no pod {name}");
        };
        let version = store.version;
        let after = {
            before["metadata"]["resourceVersion"] = json!(version.to_string());
            before.clone()
        };
        // A DELETED event carries the object's last state.
        let change = Change {
            version,
            before: Some(after.clone()),
            after: None,
        };
        store.history.push(change.clone());
        let _ = self.shared.changes.send(change);
        Instant::now()
    }

    /// Deletes a pod while history is being compacted: no watcher hears of it, and no
    /// watch can resume from before it (410 Gone) — only a new list shows it is gone.
    pub fn delete_unseen(&self, name: &str) {
        let mut store = self.shared.store.lock().unwrap();
        store.version += 1;
        store.pods.remove(name).unwrap();
        store.oldest_watchable = store.version;
        store.history.clear();
    }

    /// Closes every open watch connection mid-stream.
    pub fn cut_watches(&self) {
        self.shared.cuts.send_modify(|n| *n += 1);
    }

    /// The requests served so far (`list …` or `watch …`).
    pub fn log(&self) -> Vec<String> {
        self.shared.log.lock().unwrap().clone()
    }

    fn record(&self, store: &mut Store, before: Option<Value>, after: Option<Value>) -> Instant {
        let change = Change {
            version: store.version,
            before,
            after,
        };
        store.history.push(change.clone());
        let _ = self.shared.changes.send(change);
        Instant::now()
    }
}

/// Whether `pod` has every label of `selector` (`k=v,k2=v2`).
fn matches(pod: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .all(|kv| match kv.split_once('=') {
            Some((k, v)) => pod["metadata"]["labels"][k] == v,
            None => false,
        })
}

/// The watch event `change` is to a watch of `selector`, if any.
fn event_for(change: &Change, selector: &str) -> Option<Value> {
    let was = change.before.as_ref().filter(|p| matches(p, selector));
    let is = change.after.as_ref().filter(|p| matches(p, selector));
    match (was, is) {
        (None, Some(pod)) => Some(json!({"type": "ADDED", "object": pod})),
        (Some(_), Some(pod)) => Some(json!({"type": "MODIFIED", "object": pod})),
        (Some(old), None) => {
            // Left the selector (relabelled) or deleted: the last state it had.
            let object = change.after.as_ref().unwrap_or(old);
            Some(json!({"type": "DELETED", "object": object}))
        }
        (None, None) => None,
    }
}

fn line(value: &Value) -> Result<Bytes, std::io::Error> {
    let mut text = value.to_string();
    text.push('\n');
    Ok(Bytes::from(text))
}

async fn pods(
    State(shared): State<Arc<Shared>>,
    Path(namespace): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if namespace != shared.namespace {
        return (
            StatusCode::FORBIDDEN,
            axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "reason": "Forbidden", "code": 403,
                "message": format!("pods is forbidden in namespace {namespace}")})),
        )
            .into_response();
    }
    let selector = query.get("labelSelector").cloned().unwrap_or_default();
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let mut sorted: Vec<_> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    sorted.sort();
    shared.log.lock().unwrap().push(format!(
        "{} {}",
        if watching { "watch" } else { "list" },
        sorted.join("&")
    ));
    if !watching {
        let store = shared.store.lock().unwrap();
        let items: Vec<&Value> = store
            .pods
            .values()
            .filter(|p| matches(p, &selector))
            .collect();
        return axum::Json(json!({
            "apiVersion": "v1",
            "kind": "PodList",
            "metadata": {"resourceVersion": store.version.to_string()},
            "items": items,
        }))
        .into_response();
    }
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let (backlog, mut live, current) = {
        let store = shared.store.lock().unwrap();
        if from < store.oldest_watchable {
            let gone = json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "reason": "Expired", "code": 410,
                "message": format!("too old resource version: {from} ({})", store.oldest_watchable)}});
            return Response::new(Body::from(line(&gone).unwrap()));
        }
        let backlog: Vec<Change> = store
            .history
            .iter()
            .filter(|c| c.version > from)
            .cloned()
            .collect();
        (backlog, shared.changes.subscribe(), store.version)
    };
    let mut cuts = shared.cuts.subscribe();
    cuts.mark_unchanged();
    tokio::spawn(async move {
        let mut sent = from;
        for change in backlog {
            sent = change.version;
            if let Some(event) = event_for(&change, &selector) {
                if tx.send(line(&event)).await.is_err() {
                    return;
                }
            }
        }
        let bookmark = |version: u64| {
            json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"resourceVersion": version.to_string(),
                    "annotations": {"k8s.io/initial-events-end": "true"}}}})
        };
        if tx.send(line(&bookmark(current.max(sent)))).await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                change = live.recv() => {
                    let Ok(change) = change else { return };
                    if change.version <= sent {
                        continue;
                    }
                    sent = change.version;
                    if let Some(event) = event_for(&change, &selector) {
                        if tx.send(line(&event)).await.is_err() {
                            return;
                        }
                    }
                }
                _ = cuts.changed() => {
                    // An error ends the body without its last chunk: the connection
                    // breaks mid-stream, as when an API server or a proxy goes away.
                    let _ = tx.send(Err(std::io::Error::other("cut"))).await;
                    return;
                }
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::builder()
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}
