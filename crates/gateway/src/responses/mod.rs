//! OpenAI's Responses API (`/v1/responses`) through every mode: to one aggregated
//! worker; over P/D with vLLM's sequential handoff (a one-token, unstored prefill leg,
//! then the decode leg with P's handle) or SGLang's bootstrap handoff; or to the
//! orchestrating decode worker, which runs its own prefill leg.
//!
//! `previous_response_id` is the conversation's handle. The worker that answered stores
//! the response; the gateway remembers which worker that was and the conversation
//! ([`crate::sessions::response_chains`]), so a later turn goes back to that worker (routed like a
//! `conversation_id`), and over P/D the prefill worker, which never saw the conversation,
//! is sent all of it while it reads the last decode's blocks instead of recomputing them.
//! A response this gateway does not know (another replica relayed it) is looked for on
//! the workers; its worker alone serves the next turn. `GET` and `DELETE
//! /v1/responses/{id}` go to the worker that holds the response.

mod edits;
mod request;
mod serve;
mod stored;

pub use serve::create;
pub use stored::{delete, retrieve};
