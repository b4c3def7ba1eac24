//! The worker fleet: the live registry and its health, where workers come from
//! (discovery), what they say they cache (KV events) and how busy they are (load).

pub mod discovery;
pub mod identity;
pub mod kv_events;
pub mod load;
pub mod registry;
