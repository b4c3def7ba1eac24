//! `GET /health`, `/readiness` and `/liveness`: whether the gateway can serve a request
//! now, and whether the process is alive.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use http::StatusCode;
use serde_json::{json, Value};

use crate::registry::Mode;
use crate::state::AppState;

/// `GET /health` and `GET /readiness`: 200 when a healthy prefill and decode worker (or a
/// healthy prefill_decode worker) is there, else 503 saying what is missing.
pub async fn readiness(State(state): State<Arc<AppState>>) -> (StatusCode, Json<Value>) {
    let roster = state.registry.snapshot();
    let mode = roster.mode();
    let live = |role| roster.live(role).len();
    use pdserve_protocol::WorkerRole as R;
    let body = json!({
        "status": if mode == Mode::Unavailable { "unavailable" } else { "ok" },
        "mode": mode.as_str(),
        "missing": roster.missing(),
        "live_workers": {
            "prefill": live(R::Prefill),
            "decode": live(R::Decode),
            "prefill_decode": live(R::PrefillDecode),
            "encode": live(R::Encode),
        },
        "registered_workers": roster.members().len(),
        "cached_conversations": state.conversations.len(),
    });
    let status = if mode == Mode::Unavailable {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, Json(body))
}

/// `GET /liveness`: 200 while the process runs.
pub async fn liveness() -> Json<Value> {
    Json(json!({"status": "alive"}))
}
