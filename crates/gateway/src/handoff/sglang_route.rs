//! The routes served with SGLang's bootstrap handoff, and the shape of the bootstrap
//! fields each carries.

use pdserve_protocol::BootstrapShape;
use serde_json::Value;

use crate::legs::prompt_logprobs::wants_prompt_logprobs;

/// The routes served with SGLang's bootstrap handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglangRoute {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// SGLang's native `/generate`.
    Generate,
    /// `/v1/responses`.
    Responses,
}

impl SglangRoute {
    /// How the route's body carries the bootstrap fields.
    pub fn shape(self) -> BootstrapShape {
        match self {
            // One room at the top level, as a chat request with `n` 1 has it.
            Self::Chat | Self::Responses => BootstrapShape::Chat,
            Self::Completions => BootstrapShape::Completion,
            Self::Generate => BootstrapShape::Generate,
        }
    }

    /// The OpenAI endpoint whose stream the route answers with, where its first token
    /// can lead the answer (chat and completions).
    pub fn endpoint(self) -> Option<crate::endpoint::Endpoint> {
        match self {
            Self::Chat => Some(crate::endpoint::Endpoint::Chat),
            Self::Completions => Some(crate::endpoint::Endpoint::Completions),
            Self::Generate | Self::Responses => None,
        }
    }

    /// How the route's streams end and fail.
    pub fn dialect(self) -> crate::legs::sse::StreamDialect {
        match self {
            Self::Responses => crate::legs::sse::StreamDialect::Responses,
            _ => crate::legs::sse::StreamDialect::Chat,
        }
    }
}

/// The path (and metrics label) of SGLang's native route, on the gateway and the workers.
pub const GENERATE_ROUTE: &str = "/generate";

/// Whether a request on `route` asks for input (prompt) logprobs, so P's answer must be
/// awaited and merged: `return_logprob` on `/generate`, the prompt's logprobs on
/// completions ([`wants_prompt_logprobs`]).
pub fn wants_input_logprobs(route: SglangRoute, body: &serde_json::Map<String, Value>) -> bool {
    match route {
        SglangRoute::Generate => match body.get("return_logprob") {
            Some(Value::Bool(b)) => *b,
            Some(Value::Array(items)) => items.iter().any(|v| v.as_bool() == Some(true)),
            _ => false,
        },
        SglangRoute::Completions => wants_prompt_logprobs(body),
        SglangRoute::Chat | SglangRoute::Responses => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_input_logprob_requests_wait_for_prefill() {
        let object = |v: Value| v.as_object().unwrap().clone();
        let yes = [
            (SglangRoute::Generate, json!({"return_logprob": true})),
            (
                SglangRoute::Generate,
                json!({"return_logprob": [false, true]}),
            ),
            (
                SglangRoute::Completions,
                json!({"echo": true, "logprobs": 0}),
            ),
        ];
        for (route, body) in yes {
            assert!(wants_input_logprobs(route, &object(body.clone())), "{body}");
        }
        let no = [
            (SglangRoute::Generate, json!({})),
            (SglangRoute::Completions, json!({"logprobs": 2})),
            (SglangRoute::Completions, json!({"echo": true})),
            (SglangRoute::Chat, json!({"logprobs": true})),
        ];
        for (route, body) in no {
            assert!(
                !wants_input_logprobs(route, &object(body.clone())),
                "{body}"
            );
        }
    }
}
