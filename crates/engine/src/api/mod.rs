//! The worker's HTTP layer: OpenAI chat and completions, `/v1/models`, `/health` and
//! `/metrics`. The only place engine errors become HTTP statuses and OpenAI bodies.

mod chat;
mod completions;
pub mod generation;
pub mod server;
pub mod validate;

pub use server::{router, AppState, MAX_BODY_BYTES};
