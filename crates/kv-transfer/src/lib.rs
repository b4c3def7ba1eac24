//! KV block transfer between pdserve engine processes.
//!
//! A peer that holds blocks (a prefill worker after prefill, or a decode worker that kept
//! a finished conversation) runs [`server::serve`] over a [`BlockSource`]; a peer that
//! needs them calls [`client::pull`]. The wire format is documented in this crate's
//! README: length-prefixed, versioned frames; JSON control messages; raw block bytes.

pub mod auth;
pub mod client;
pub mod error;
pub mod frame;
pub mod message;
pub mod peers;
pub mod pending;
pub mod pins;
pub mod server;

pub use auth::TransferSecret;
pub use client::{pull, PullConfig, PulledBlocks};
pub use error::TransferError;
pub use message::{ErrorCode, ReadAccepted, ReadRequest, ReusedTokens};
pub use peers::{InvalidPeer, PeerAllowList};
pub use pending::{NextBlock, Pending, PendingBlocks};
pub use pins::PinTable;
pub use server::{BlockSource, Export, ReadOutcome, ServerConfig, TransferStats};
