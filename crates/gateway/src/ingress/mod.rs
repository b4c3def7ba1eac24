//! What a client's request is before it is routed: its parsed body, its place in the
//! admission queue, its access-log line, the gateways it already passed, its tokens and
//! its latency objectives.

pub mod access;
pub mod admission;
pub mod hops;
pub mod prompt_tokens;
pub mod request;
pub mod slo;
