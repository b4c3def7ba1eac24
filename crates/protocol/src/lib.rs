//! Wire types shared by the pdserve gateway, engine and bench.
//!
//! Every request and response type keeps the fields it does not model in an `extra`
//! map, so a gateway built on these types passes vendor extensions through unchanged.

pub mod error;
pub mod kv;
pub mod kv_events;
pub mod leg;
pub mod openai;
pub mod responses;
pub mod role;
pub mod session;
pub mod sse;
pub mod tokenize;

pub use error::{error_chain, ApiError, ErrorBody, ErrorDetail};
pub use kv::{BootstrapParams, BootstrapShape, KvTransferParams, RemoteBlockIds};
pub use leg::LegFault;
pub use openai::*;
pub use role::{UnknownRole, WorkerRole};
