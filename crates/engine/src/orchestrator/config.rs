//! What `--prefill` and its companion flags configure for the orchestrating decode
//! worker.

use std::time::Duration;

/// How the KV moves from the prefill worker to this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HandoffMode {
    /// The prefill worker answers with where its KV is; then this worker reads it.
    #[default]
    Sequential,
    /// This worker starts reading while the prefill runs: the read waits for the blocks,
    /// under an id this worker chose, and the prefill answer is raced against the decode.
    Concurrent,
}

/// Whether a request starts from the prefill worker's first token
/// (`--first-token-from-prefill`): the prefill leg samples it with the request's own
/// sampling and answers its id (`return_token_ids`); this worker reports it at once and
/// decodes from the second token, one step sooner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FirstTokenFromPrefill {
    /// Per answer: used where the prefill answer carries the token's id (a pdserve
    /// worker, vLLM with `return_token_ids`); otherwise this worker samples it again.
    #[default]
    Auto,
    /// As `auto`, and a prefill answer without the id is logged as a warning.
    On,
    /// Never; a request's own `"first_token_from_prefill": true` still turns it on.
    Off,
}

impl FirstTokenFromPrefill {
    /// Whether a request that says `choice` (its `first_token_from_prefill` field)
    /// takes the prefill's token under this mode.
    pub fn wanted(self, choice: Option<bool>) -> bool {
        choice.unwrap_or(self != Self::Off)
    }
}

/// What `--prefill` and its companion flags configure.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// Base URLs of the prefill workers (`http://host:port`, no trailing slash).
    pub prefill: Vec<String>,
    /// Sequential or concurrent handoff.
    pub handoff: HandoffMode,
    /// Whether requests start from the prefill worker's first token.
    pub first_token_from_prefill: FirstTokenFromPrefill,
    /// Longest wait for a prefill worker's answer.
    pub prefill_timeout: Duration,
    /// Time between pre-warm attempts, and between health probes of warm workers.
    pub prewarm_interval: Duration,
    /// Pre-warm attempts per appearance of a prefill worker before giving up (until its
    /// `/health` answers again).
    pub prewarm_attempts: u32,
    /// Bearer key sent to the prefill workers (this worker's own `--api-key`: `pdserve up
    /// --api-key` gives every worker the same one).
    pub prefill_api_key: Option<String>,
}

/// Checks a `--prefill` value and returns it without a trailing slash.
pub fn prefill_url(raw: &str) -> Result<String, String> {
    let url = raw.trim().trim_end_matches('/');
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "--prefill {raw:?}: expected http://host:port (workers speak plain HTTP)"
        ));
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(format!(
            "--prefill {raw:?}: expected http://host:port with no path"
        ));
    }
    Ok(url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_urls_are_plain_http_bases() {
        assert_eq!(
            prefill_url("http://127.0.0.1:8100/").unwrap(),
            "http://127.0.0.1:8100"
        );
        assert_eq!(prefill_url("http://p:1").unwrap(), "http://p:1");
        for bad in ["127.0.0.1:8100", "https://p:1", "http://", "http://p:1/v1"] {
            assert!(prefill_url(bad).is_err(), "{bad}");
        }
    }
}
