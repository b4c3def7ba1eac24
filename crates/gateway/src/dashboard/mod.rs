//! The live status page: `GET /dashboard` (one self-contained HTML page: inline CSS and
//! JS, no external URL, so it works offline) and `GET /dashboard/data` (the JSON it polls
//! once a second). Like `/metrics` and `/instances` both are open under `--api-key`: they
//! show the roster and request ids, never a prompt or an answer.

pub mod data;
pub mod history;
pub mod journey;

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::header;

use crate::state::AppState;

/// The page, embedded in the binary.
pub const PAGE: &str = include_str!("page.html");

/// `GET /dashboard`: the page.
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /dashboard/data`: the roster, per-second samples and recent requests.
pub async fn data(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(data::DashboardData::collect(&state)),
    )
        .into_response()
}
