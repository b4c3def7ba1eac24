//! `GET /planner`: the P:D planner's latest decision (see [`crate::planner`]) as JSON:
//! the desired `prefill` and `decode` counts (at least 1 each), the `reason`, and what
//! it was decided from.

use axum::extract::State;
use axum::Json;

use crate::planner::Plan;
use crate::state::AppState;

/// The latest decision, or one made now when the planner has not decided yet.
pub async fn planner(State(state): State<AppState>) -> Json<Plan> {
    Json(state.planner.latest(&state.serving))
}
