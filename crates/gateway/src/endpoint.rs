//! The OpenAI endpoints a generation request can target.

/// The OpenAI endpoint a generation request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses` (OpenAI's Responses API).
    Responses,
}

impl Endpoint {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Responses => "/v1/responses",
        }
    }
}
