//! The routes served with SGLang's bootstrap handoff, and the shape of the bootstrap
//! fields each carries.

use pdserve_protocol::BootstrapShape;

/// The routes served with SGLang's bootstrap handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglangRoute {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// SGLang's native `/generate`.
    Generate,
}

impl SglangRoute {
    /// How the route's body carries the bootstrap fields.
    pub fn shape(self) -> BootstrapShape {
        match self {
            Self::Chat => BootstrapShape::Chat,
            Self::Completions => BootstrapShape::Completion,
            Self::Generate => BootstrapShape::Generate,
        }
    }
}

/// The path (and metrics label) of SGLang's native route, on the gateway and the workers.
pub const GENERATE_ROUTE: &str = "/generate";
