//! The request path's settings, resolved from the flags by the composition root
//! (`crate::state`) and taken by value: the modes and legs never read the flags.

use std::time::Duration;

/// How the gateway hands a request from prefill to decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// vLLM's sequential handoff with `kv_transfer_params`.
    #[default]
    Vllm,
    /// SGLang's bootstrap handoff: both legs at once, joined by `bootstrap_room`.
    Sglang,
}

/// Whether a streamed P/D answer's first token is the prefill worker's, sent to the
/// client as soon as the decode worker answers (`--first-token-from-prefill`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FirstTokenFromPrefill {
    /// Per answer: used where the prefill answer carries the token (its text, one per
    /// choice, and `finish_reason` `length`); otherwise the decode worker's is relayed.
    #[default]
    Auto,
    /// As `auto`, and a prefill answer without the token is logged as a warning (the
    /// operator said the workers carry it).
    On,
    /// Never; a request's own `"first_token_from_prefill": true` still turns it on.
    Off,
}

/// What the handoff modes, the legs, the encoder stage and the Responses route are told.
#[derive(Debug, Clone)]
pub struct LegSettings {
    /// The P/D handoff protocol.
    pub protocol: Protocol,
    /// Whether a streamed answer's first token comes from the prefill leg.
    pub first_token_from_prefill: FirstTokenFromPrefill,
    /// sglang: wait for the prefill response head before streaming decode.
    pub sglang_wait_prefill_head: bool,
    /// Limit for the whole prefill leg (and an encoder sub-request).
    pub prefill_timeout: Duration,
    /// Limit for the decode leg's first byte (and other single exchanges).
    pub decode_timeout: Duration,
    /// Longest gap between stream chunks.
    pub stream_idle_timeout: Duration,
    /// Limit for opening an upstream connection.
    pub connect_timeout: Duration,
    /// Limit for a worker's health answer (a stored response's worker is asked).
    pub probe_timeout: Duration,
    /// Retries of a leg on another worker before the first byte.
    pub max_retries: u32,
    /// Prompts with fewer uncached tokens skip the prefill leg.
    pub disagg_threshold: Option<usize>,
    /// ...while every live prefill worker has at least this many prefill legs in flight.
    pub disagg_min_prefill_load: u32,
    /// Most images per encoder sub-request (0: unlimited).
    pub encoder_max_batch_size: usize,
    /// Forward original media instead of metadata references.
    pub no_rewrite: bool,
    /// Whether responses name the chosen workers.
    pub expose_routing: bool,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// The workers' KV transfer secret, for release calls.
    pub kv_secret: Option<String>,
    /// Objectives for requests that name none (`--slo-ttft-ms`, `--slo-tpot-ms`).
    pub slo: crate::ingress::slo::Slo,
    /// Requests of a priority above this are shed (429) when no route is predicted to
    /// meet their objectives (`--shed-priority`).
    pub shed_priority: i64,
}
