//! The part a worker plays in serving, shared by the gateway, the engine and `pdserve up`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What a worker does in a request's path. Serialised (JSON, `/instances`) and parsed
/// (CLI) as `prefill`, `decode`, `prefill_decode` or `encode`; the CLI and the parser
/// also accept `both` for `prefill_decode`.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Computes the prompt's KV and hands it to a decode worker.
    #[value(name = "prefill")]
    Prefill,
    /// Receives a prefilled KV and generates.
    #[value(name = "decode")]
    Decode,
    /// Prefills and decodes in one process (aggregated serving, no handoff).
    #[value(name = "prefill_decode", alias = "both")]
    PrefillDecode,
    /// Runs a multimodal encoder and publishes its embeddings.
    #[value(name = "encode")]
    Encode,
}

impl WorkerRole {
    /// Every role, in display order.
    pub const ALL: [WorkerRole; 4] = [
        Self::Prefill,
        Self::Decode,
        Self::PrefillDecode,
        Self::Encode,
    ];

    /// The role's canonical name (`prefill_decode`, not the `both` alias).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::PrefillDecode => "prefill_decode",
            Self::Encode => "encode",
        }
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is none of the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker role `{0}` (expected prefill, decode, prefill_decode or encode)")]
pub struct UnknownRole(pub String);

impl FromStr for WorkerRole {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "prefill_decode" | "both" => Ok(Self::PrefillDecode),
            "encode" => Ok(Self::Encode),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn names_aliases_and_json() {
        for role in WorkerRole::ALL {
            assert_eq!(role.as_str().parse::<WorkerRole>().unwrap(), role);
            assert_eq!(
                <WorkerRole as ValueEnum>::from_str(role.as_str(), false).unwrap(),
                role
            );
            assert_eq!(
                serde_json::to_string(&role).unwrap(),
                format!("\"{}\"", role.as_str())
            );
        }
        assert_eq!(
            <WorkerRole as ValueEnum>::from_str("both", false).unwrap(),
            WorkerRole::PrefillDecode
        );
        assert_eq!(
            "both".parse::<WorkerRole>().unwrap(),
            WorkerRole::PrefillDecode
        );
        assert!("aggregated".parse::<WorkerRole>().is_err());
        assert!(serde_json::from_str::<WorkerRole>("\"both\"").is_err());
    }
}
