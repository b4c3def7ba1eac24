//! The serving core, below the HTTP layer: the context every way of serving submits
//! through, a sequence's output, and a request's submitted choices. Nothing here knows
//! about routes or response shapes; `api/`, `bootstrap/` and `orchestrator/` build on it.

mod context;
mod limits;
pub mod output;
mod prompt_echo;
pub mod submission;

pub use context::ServingContext;
pub use limits::ModelLimits;
pub use output::{
    ChoiceOutput, Companion, EchoPlan, Generation, Piece, PromptEcho, PromptScores, ResolvedLogprob,
};
pub use prompt_echo::{PromptScore, PromptToken};
pub use submission::{choice_request, Submitted};
