//! The HTTP clients the gateway talks to workers with: the pooled client for whole
//! answers, the direct client for streamed legs, and the workers' context lengths.

pub mod direct;
pub mod model_len;
pub mod worker_client;
