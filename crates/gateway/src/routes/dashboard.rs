//! The live status page: `GET /dashboard` (one self-contained HTML page: inline CSS and
//! JS, no external URL, so it works offline) and `GET /dashboard/data` (the JSON it polls
//! once a second). Like `/metrics` and `/instances` both are open under `--api-key`: they
//! show the roster and request ids, never a prompt or an answer.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::header;
use pdserve_http_server::dashboard::DashboardPage;

use crate::serving::Serving;

/// The page, embedded in the binary (its script starts with the one both pages share).
pub static PAGE: DashboardPage = DashboardPage::new(include_str!("dashboard.html"));

/// `GET /dashboard`: the page.
pub async fn page() -> Response {
    PAGE.response()
}

/// `GET /dashboard/data`: the roster, per-second samples and recent requests.
pub async fn data(State(state): State<Arc<Serving>>) -> Response {
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(crate::routes::dashboard_data::DashboardData::collect(
            &state,
        )),
    )
        .into_response()
}
