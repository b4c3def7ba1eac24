//! `GET /health`, `/readiness` and `/liveness`: whether the gateway can serve a request
//! now, and whether the process is alive.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderName, StatusCode};
use serde_json::json;

use crate::fleet::identity::{SERVER_NAME, X_PDSERVE_GATEWAY};
use crate::fleet::registry::Mode;
use crate::state::AppState;

/// `GET /health` and `GET /readiness`: 200 when a healthy prefill and decode worker (or a
/// healthy prefill_decode worker) is there, else 503 saying what is missing. Like every
/// health route, it names the gateway (`x-pdserve-gateway`, `server`, `instance_id`) so
/// that no gateway takes it for a worker.
pub async fn readiness(State(state): State<AppState>) -> Response {
    let roster = state.serving.registry.snapshot();
    let mode = roster.mode();
    let live = |role| roster.live(role).len();
    use pdserve_protocol::WorkerRole as R;
    let body = json!({
        "status": if mode == Mode::Unavailable { "unavailable" } else { "ok" },
        "server": SERVER_NAME,
        "instance_id": state.instance.id(),
        "mode": mode.as_str(),
        "missing": roster.missing(),
        "live_workers": {
            "prefill": live(R::Prefill),
            "decode": live(R::Decode),
            "prefill_decode": live(R::PrefillDecode),
            "encode": live(R::Encode),
        },
        "registered_workers": roster.members().len(),
        "cached_conversations": state.serving.conversations.len(),
    });
    let status = if mode == Mode::Unavailable {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, named(&state), Json(body)).into_response()
}

/// `GET /liveness`: 200 while the process runs.
pub async fn liveness(State(state): State<AppState>) -> Response {
    let body = json!({
        "status": "alive",
        "server": SERVER_NAME,
        "instance_id": state.instance.id(),
    });
    (named(&state), Json(body)).into_response()
}

/// The header that names this gateway.
fn named(state: &AppState) -> [(HeaderName, http::HeaderValue); 1] {
    [(
        HeaderName::from_static(X_PDSERVE_GATEWAY),
        state.instance.header().clone(),
    )]
}
