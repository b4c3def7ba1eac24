//! The worker's HTTP layer: OpenAI chat and completions, `/v1/models`, `/health` and
//! `/metrics`, SGLang's native routes and the KV release route. The only place engine
//! errors become HTTP statuses and OpenAI bodies.

mod body;
mod chat;
pub mod choices;
mod completions;
pub mod dashboard;
mod error;
pub mod http_layers;
mod kv_release;
pub mod prepared;
pub mod response_format;
mod response_store;
mod responses;
pub mod sampling_fields;
pub mod server;
pub mod server_info;
pub mod sglang_generate;
mod sglang_generate_rooms;
mod state;
mod tokenize;
pub mod unsupported;
pub mod validate;

pub use server::{router, MAX_BODY_BYTES};
pub use state::AppState;
