//! What the gateway remembers between requests: decode KV handles kept for a
//! conversation's next turn, and items in the shapes the history store keeps.

pub mod conversation;
pub mod history_items;
