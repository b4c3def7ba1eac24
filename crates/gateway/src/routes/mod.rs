//! The HTTP routes besides generation: the admin roster, the Conversations API,
//! tokenize, profiling, readiness, the dashboard, and the API-key layer in front of them.

pub mod admin;
pub mod auth;
pub mod conversations;
pub mod dashboard;
pub mod dashboard_data;
pub mod planner;
pub mod profile;
pub mod readiness;
pub mod tokenize;
