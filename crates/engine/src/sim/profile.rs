//! A simulated engine's profile: the KV pool and scheduler limits of the engine it
//! stands in for, what one step costs, and the P/D link. Profiles are YAML files; those in
//! `crates/engine/sim-profiles/` are built in and named by their file stem.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::step_shape::StepShape;

/// The built-in profiles: (name, YAML).
const BUILT_IN: &[(&str, &str)] = &[
    (
        "cpu-smollm2",
        include_str!("../../sim-profiles/cpu-smollm2.yaml"),
    ),
    (
        "h100-llama-3.1-8b",
        include_str!("../../sim-profiles/h100-llama-3.1-8b.yaml"),
    ),
    (
        "h100x4-llama-3.1-70b",
        include_str!("../../sim-profiles/h100x4-llama-3.1-70b.yaml"),
    ),
    (
        "vllm-cpu-smollm2",
        include_str!("../../sim-profiles/vllm-cpu-smollm2.yaml"),
    ),
];

/// Why a profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Neither a built-in name nor a readable file.
    #[error("no sim profile {spec:?}: not a built-in profile ({builtin}) and not a readable file: {source}")]
    NotFound {
        /// What was asked for.
        spec: String,
        /// The built-in names.
        builtin: String,
        /// Why the file could not be read.
        source: std::io::Error,
    },
    /// Not YAML of the profile's shape (serde names the field).
    #[error("sim profile {profile}: {message}")]
    Parse {
        /// The profile's name or path.
        profile: String,
        /// What is wrong, and where.
        message: String,
    },
    /// A field's value is out of range.
    #[error("sim profile {profile}: field {field}: {reason}")]
    Field {
        /// The profile's name or path.
        profile: String,
        /// The field, as `section.key`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// One simulated engine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimProfile {
    /// Short name (`h100-llama-3.1-8b`).
    pub name: String,
    /// What hardware and software it stands in for.
    pub description: String,
    /// Facts of the served model.
    pub model: ModelFacts,
    /// The engine's scheduler limits.
    pub scheduler: SchedulerLimits,
    /// What one step costs.
    pub step: StepCost,
    /// Roles whose steps cost otherwise (`prefill`, `decode`, `prefill_decode`): on one
    /// CPU box `pdserve up` gives the prefill worker more cores than the decode worker.
    #[serde(default)]
    pub role_step: BTreeMap<String, StepCost>,
    /// The P/D KV transfer link.
    pub link: LinkCost,
}

/// Facts of the served model that the simulation needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFacts {
    /// Bytes of KV one token takes (layers x KV heads x head dim x 2 x dtype bytes).
    pub kv_bytes_per_token: u64,
    /// Longest sequence served.
    pub max_model_len: usize,
}

/// The scheduler limits of the engine simulated (as vLLM's flags of the same names).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerLimits {
    /// KV pool, in blocks of 16 tokens.
    pub num_kv_blocks: usize,
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most tokens in one step: the chunked-prefill budget.
    pub max_num_batched_tokens: usize,
}

/// One step's time, in microseconds:
/// `overhead + max(weights, prefill_token * P + decode_token * D)
///  + prefill_attention_per_ktoken * pairs / 1000 + decode_attention_per_ktoken * ctx / 1000`
/// with P prompt tokens computed, D sequences decoding, `pairs` the (query, key) pairs
/// the prompt tokens attend over and `ctx` the decoding sequences' context tokens.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCost {
    /// Fixed cost of every step (scheduling, launches).
    pub overhead_us: f64,
    /// The memory-bound floor of the linear layers: reading every weight once.
    pub weights_us: f64,
    /// Linear layers, per prompt token.
    pub prefill_token_us: f64,
    /// Linear layers, per decoding sequence.
    pub decode_token_us: f64,
    /// Prompt attention, per 1000 (query, key) pairs.
    pub prefill_attention_us_per_ktoken: f64,
    /// Decode attention, per 1000 context tokens read.
    pub decode_attention_us_per_ktoken: f64,
}

/// The P/D KV transfer link.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkCost {
    /// Bandwidth in GB/s (1e9 bytes a second).
    pub bandwidth_gbytes_per_s: f64,
    /// Fixed latency of one transfer.
    pub latency_us: f64,
}

/// The roles `role_step` may name.
const ROLES: [&str; 3] = ["prefill", "decode", "prefill_decode"];

impl StepCost {
    /// The first key whose value is out of range, and why.
    fn check(&self) -> Result<(), (&'static str, String)> {
        for (name, value) in [
            ("overhead_us", self.overhead_us),
            ("weights_us", self.weights_us),
            ("prefill_token_us", self.prefill_token_us),
            ("decode_token_us", self.decode_token_us),
            (
                "prefill_attention_us_per_ktoken",
                self.prefill_attention_us_per_ktoken,
            ),
            (
                "decode_attention_us_per_ktoken",
                self.decode_attention_us_per_ktoken,
            ),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err((name, format!("must be a number >= 0, not {value}")));
            }
        }
        if self.prefill_token_us <= 0.0 {
            return Err((
                "prefill_token_us",
                "must be > 0: a prompt costs time".into(),
            ));
        }
        if self.decode_token_us <= 0.0 && self.weights_us <= 0.0 && self.overhead_us <= 0.0 {
            return Err((
                "decode_token_us",
                "must be > 0 when weights_us and overhead_us are 0: a decode step costs time"
                    .into(),
            ));
        }
        Ok(())
    }

    /// How long a step of `shape` takes.
    pub fn duration(&self, shape: &StepShape) -> Duration {
        let linear = self.prefill_token_us * shape.prefill_tokens as f64
            + self.decode_token_us * shape.decode_seqs as f64;
        let us = self.overhead_us
            + linear.max(self.weights_us)
            + self.prefill_attention_us_per_ktoken * shape.prefill_attention_pairs as f64 / 1e3
            + self.decode_attention_us_per_ktoken * shape.decode_context_tokens as f64 / 1e3;
        Duration::from_secs_f64(us / 1e6)
    }
}

impl SimProfile {
    /// A built-in profile by name, or a YAML file by path.
    pub fn load(spec: &str) -> Result<Self, ProfileError> {
        if let Some((name, yaml)) = BUILT_IN.iter().find(|(name, _)| *name == spec) {
            return Self::parse(name, yaml);
        }
        let yaml =
            std::fs::read_to_string(Path::new(spec)).map_err(|source| ProfileError::NotFound {
                spec: spec.to_string(),
                builtin: Self::built_in_names().join(", "),
                source,
            })?;
        Self::parse(spec, &yaml)
    }

    /// The built-in profiles' names.
    pub fn built_in_names() -> Vec<&'static str> {
        BUILT_IN.iter().map(|(name, _)| *name).collect()
    }

    /// Every built-in profile, parsed.
    pub fn built_in() -> Result<Vec<Self>, ProfileError> {
        BUILT_IN
            .iter()
            .map(|(name, yaml)| Self::parse(name, yaml))
            .collect()
    }

    /// What a step costs on a worker of `role` (`prefill`, `decode`, `prefill_decode`).
    pub fn step_for(&self, role: &str) -> &StepCost {
        self.role_step.get(role).unwrap_or(&self.step)
    }

    /// One line for `pdserve sim profiles`: the name, what it stands in for, its limits.
    pub fn summary(&self) -> String {
        let s = &self.scheduler;
        format!(
            "{:<24} {} (KV pool {} tokens, max_num_seqs {}, max_num_batched_tokens {}, \
             KV {} KiB/token, link {} GB/s)",
            self.name,
            self.description,
            s.num_kv_blocks * pdserve_model::BLOCK_SIZE,
            s.max_num_seqs,
            s.max_num_batched_tokens,
            self.model.kv_bytes_per_token as f64 / 1024.0,
            self.link.bandwidth_gbytes_per_s,
        )
    }

    /// Parses and checks a profile; `origin` names it in errors.
    pub fn parse(origin: &str, yaml: &str) -> Result<Self, ProfileError> {
        let profile: Self = serde_yaml_ng::from_str(yaml).map_err(|e| ProfileError::Parse {
            profile: origin.to_string(),
            message: e.to_string(),
        })?;
        profile.check(origin)?;
        Ok(profile)
    }

    fn check(&self, origin: &str) -> Result<(), ProfileError> {
        let field = |field: &str, reason: &str| ProfileError::Field {
            profile: origin.to_string(),
            field: field.to_string(),
            reason: reason.to_string(),
        };
        let s = &self.scheduler;
        for (name, value) in [
            (
                "model.kv_bytes_per_token",
                self.model.kv_bytes_per_token as usize,
            ),
            ("model.max_model_len", self.model.max_model_len),
            ("scheduler.num_kv_blocks", s.num_kv_blocks),
            ("scheduler.max_num_seqs", s.max_num_seqs),
            ("scheduler.max_num_batched_tokens", s.max_num_batched_tokens),
        ] {
            if value == 0 {
                return Err(field(name, "must be at least 1"));
            }
        }
        if !(self.link.latency_us.is_finite() && self.link.latency_us >= 0.0) {
            return Err(field(
                "link.latency_us",
                &format!("must be a number >= 0, not {}", self.link.latency_us),
            ));
        }
        if !(self.link.bandwidth_gbytes_per_s.is_finite() && self.link.bandwidth_gbytes_per_s > 0.0)
        {
            return Err(field(
                "link.bandwidth_gbytes_per_s",
                &format!(
                    "must be a number > 0, not {}",
                    self.link.bandwidth_gbytes_per_s
                ),
            ));
        }
        self.step
            .check()
            .map_err(|(key, reason)| field(&format!("step.{key}"), &reason))?;
        for (role, cost) in &self.role_step {
            if !ROLES.contains(&role.as_str()) {
                let reason = format!("not a worker role (one of {})", ROLES.join(", "));
                return Err(field(&format!("role_step.{role}"), &reason));
            }
            cost.check()
                .map_err(|(key, reason)| field(&format!("role_step.{role}.{key}"), &reason))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
name: t
description: a test engine
model: {kv_bytes_per_token: 1024, max_model_len: 4096}
scheduler: {num_kv_blocks: 100, max_num_seqs: 8, max_num_batched_tokens: 256}
step:
  overhead_us: 100
  weights_us: 1000
  prefill_token_us: 10
  decode_token_us: 20
  prefill_attention_us_per_ktoken: 2
  decode_attention_us_per_ktoken: 4
link: {bandwidth_gbytes_per_s: 1, latency_us: 50}
";

    #[test]
    fn built_in_profiles_parse() {
        let all = SimProfile::built_in().unwrap();
        assert_eq!(all.len(), BUILT_IN.len());
        for (profile, (name, _)) in all.iter().zip(BUILT_IN) {
            assert_eq!(&profile.name, name, "a profile's name is its file stem");
        }
    }

    #[test]
    fn a_step_costs_what_the_formula_says() {
        let p = SimProfile::parse("t", GOOD).unwrap();
        let shape = |prefill_tokens, pairs, decode_seqs, ctx| StepShape {
            prefill_tokens,
            prefill_attention_pairs: pairs,
            decode_seqs,
            decode_context_tokens: ctx,
        };
        let us = |s: StepShape| p.step.duration(&s).as_secs_f64() * 1e6;
        // Small decode batch: the weight read is the floor.
        assert!((us(shape(0, 0, 10, 2000)) - (100.0 + 1000.0 + 8.0)).abs() < 1e-6);
        // A big prompt chunk: compute-bound.
        assert!((us(shape(200, 20_000, 0, 0)) - (100.0 + 2000.0 + 40.0)).abs() < 1e-6);
    }

    #[test]
    fn a_malformed_profile_names_the_field() {
        let cases = [
            (GOOD.replace("max_num_seqs: 8", "max_num_seqs: 0"), "scheduler.max_num_seqs"),
            (GOOD.replace("weights_us: 1000", "weights_us: -1"), "step.weights_us"),
            (GOOD.replace("weights_us: 1000", "weights_us: .nan"), "step.weights_us"),
            (
                GOOD.replace("bandwidth_gbytes_per_s: 1", "bandwidth_gbytes_per_s: 0"),
                "link.bandwidth_gbytes_per_s",
            ),
            (GOOD.replace("  decode_token_us: 20\n", ""), "decode_token_us"),
            (GOOD.replace("latency_us: 50", "latency_us: 50, jitter_us: 1"), "jitter_us"),
            (GOOD.replace("max_model_len: 4096", "max_model_len: long"), "max_model_len"),
            (
                format!("{GOOD}role_step:\n  decode: {{overhead_us: 1, weights_us: 0, prefill_token_us: 0, decode_token_us: 1, prefill_attention_us_per_ktoken: 0, decode_attention_us_per_ktoken: 0}}\n"),
                "role_step.decode.prefill_token_us",
            ),
            (
                format!("{GOOD}role_step:\n  encode: {{overhead_us: 1, weights_us: 0, prefill_token_us: 1, decode_token_us: 1, prefill_attention_us_per_ktoken: 0, decode_attention_us_per_ktoken: 0}}\n"),
                "role_step.encode",
            ),
        ];
        for (yaml, named) in cases {
            let err = SimProfile::parse("t", &yaml).unwrap_err().to_string();
            assert!(err.contains(named), "{named}: {err}");
        }
    }

    #[test]
    fn an_unknown_name_lists_the_built_in_ones() {
        let err = SimProfile::load("no-such-profile").unwrap_err().to_string();
        assert!(err.contains("cpu-smollm2"), "{err}");
    }
}
