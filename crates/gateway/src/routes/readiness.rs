//! `GET /health`, `/readiness` and `/liveness`: whether the gateway can serve a request
//! now, and whether the process is alive.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderName, StatusCode};
use serde_json::json;

use crate::fleet::identity::{Instance, SERVER_NAME, X_PDSERVE_GATEWAY};
use crate::fleet::registry::Mode;
use crate::serving::Serving;

/// `GET /health` and `GET /readiness`: 200 when a healthy prefill and decode worker (or a
/// healthy prefill_decode worker) is there, else 503 saying what is missing. Like every
/// health route, it names the gateway (`x-pdserve-gateway`, `server`, `instance_id`) so
/// that no gateway takes it for a worker.
pub async fn readiness(
    State(serving): State<Arc<Serving>>,
    State(instance): State<Arc<Instance>>,
) -> Response {
    let roster = serving.registry.snapshot();
    let mode = roster.mode();
    let live = |role| roster.live(role).len();
    use pdserve_protocol::WorkerRole as R;
    let body = json!({
        "status": if mode == Mode::Unavailable { "unavailable" } else { "ok" },
        "server": SERVER_NAME,
        "instance_id": instance.id(),
        "mode": mode.as_str(),
        "missing": roster.missing(),
        "live_workers": {
            "prefill": live(R::Prefill),
            "decode": live(R::Decode),
            "prefill_decode": live(R::PrefillDecode),
            "encode": live(R::Encode),
        },
        "registered_workers": roster.members().len(),
        "cached_conversations": serving.conversations.len(),
    });
    let status = if mode == Mode::Unavailable {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, named(&instance), Json(body)).into_response()
}

/// `GET /liveness`: 200 while the process runs.
pub async fn liveness(State(instance): State<Arc<Instance>>) -> Response {
    let body = json!({
        "status": "alive",
        "server": SERVER_NAME,
        "instance_id": instance.id(),
    });
    (named(&instance), Json(body)).into_response()
}

/// The header that names this gateway.
fn named(instance: &Instance) -> [(HeaderName, http::HeaderValue); 1] {
    [(
        HeaderName::from_static(X_PDSERVE_GATEWAY),
        instance.header().clone(),
    )]
}
