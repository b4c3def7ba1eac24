//! What the gateway remembers between requests: decode KV handles kept for a
//! conversation's next turn, and which worker holds each stored Response.

pub mod conversation;
pub mod response_chains;
