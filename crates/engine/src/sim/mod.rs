//! The simulated engine behind `pdserve worker --sim PROFILE`: the forward pass is
//! replaced by a timing model ([`SimModel`]); the API, scheduler, block manager, prefix
//! cache, KV events, P/D protocols and KV transfer are the real engine's.

mod model;
mod profile;

pub use model::{block_bytes, SimModel, TokenChoice, SIM_KV_LAYOUT};
pub use profile::{LinkCost, ProfileError, SimProfile, StepCost};
