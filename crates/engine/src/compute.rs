//! What runs a worker's forward steps: the GGUF model on the CPU, or, with `--sim`, a
//! simulated GPU engine timed by a profile. Everything above the step model is the same
//! for both; this is where they differ.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pdserve_model::{Model, ModelError, ModelText, BLOCK_SIZE};
use prometheus_client::metrics::histogram::Histogram;

use crate::args::{
    WorkerArgs, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_KV_BLOCKS,
};
use crate::kv::SimulatedLink;
use crate::sim::{self, ProfileError, SimModel, SimProfile, TokenChoice};
use crate::step_model::{ModelRunner, StepModel};

/// Why the compute could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// The model could not be loaded.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// The `--sim` profile is unusable.
    #[error("{0}")]
    Profile(#[from] ProfileError),
    /// A flag does not fit the model or profile.
    #[error("{0}")]
    InvalidArgs(String),
}

/// The scheduler's limits, from the flags or the sim profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Blocks in the KV pool.
    pub num_kv_blocks: usize,
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Longest sequence served.
    pub max_model_len: usize,
}

/// A worker's step model and what the rest of the worker needs to know of it.
pub struct Compute {
    /// Runs the forward steps on the scheduler thread.
    pub step_model: Box<dyn StepModel>,
    /// Tokenizer, chat template and shapes.
    pub text: Arc<ModelText>,
    /// The KV block format peers must share.
    pub kv_layout: String,
    /// Bytes of one KV block.
    pub kv_block_bytes: usize,
    /// Scheduler limits.
    pub limits: EngineLimits,
    /// The simulated P/D link, with `--sim`.
    pub link: Option<SimulatedLink>,
    /// The sim profile's name, with `--sim`.
    pub sim_profile: Option<String>,
}

impl Compute {
    /// Loads the model at `path`, or with `--sim` its tokenizer and the profile;
    /// `lateness` receives a sim step's lateness (blocking: call off the runtime).
    pub fn load(
        args: &WorkerArgs,
        path: &Path,
        lateness: Option<Histogram>,
    ) -> Result<Self, ComputeError> {
        match &args.sim {
            Some(spec) => Self::simulated(
                args,
                spec,
                path,
                lateness.unwrap_or_else(|| Histogram::new(std::iter::empty())),
            ),
            None => Self::real(args, path),
        }
    }

    fn real(args: &WorkerArgs, path: &Path) -> Result<Self, ComputeError> {
        let model = Arc::new(Model::load(path)?);
        let text = model.text();
        let max_model_len = max_model_len(
            args,
            text.config().context_length,
            "the model's context length",
        )?;
        let runner = ModelRunner::new(model, args.num_kv_blocks);
        Ok(Self {
            kv_layout: runner.kv_layout(),
            kv_block_bytes: runner.kv_block_bytes(),
            step_model: Box::new(runner),
            text,
            limits: EngineLimits {
                num_kv_blocks: args.num_kv_blocks,
                max_num_seqs: args.max_num_seqs,
                max_num_batched_tokens: args.max_num_batched_tokens,
                max_model_len: max_model_len.min(args.num_kv_blocks * BLOCK_SIZE),
            },
            link: None,
            sim_profile: None,
        })
    }

    fn simulated(
        args: &WorkerArgs,
        spec: &str,
        path: &Path,
        lateness: Histogram,
    ) -> Result<Self, ComputeError> {
        // The profile sets these: a flag that asks otherwise would be silently ignored.
        for (flag, value, default, field) in [
            (
                "--num-kv-blocks",
                args.num_kv_blocks,
                DEFAULT_NUM_KV_BLOCKS,
                "num_kv_blocks",
            ),
            (
                "--max-num-seqs",
                args.max_num_seqs,
                DEFAULT_MAX_NUM_SEQS,
                "max_num_seqs",
            ),
            (
                "--max-num-batched-tokens",
                args.max_num_batched_tokens,
                DEFAULT_MAX_NUM_BATCHED_TOKENS,
                "max_num_batched_tokens",
            ),
        ] {
            if value != default {
                return Err(ComputeError::InvalidArgs(format!(
                    "{flag} does not apply with --sim: the profile's scheduler.{field} sets it \
                     (give --sim a copy of the profile with the value you want)"
                )));
            }
        }
        let profile = SimProfile::load(spec)?;
        let text = Arc::new(ModelText::load(path)?);
        let s = &profile.scheduler;
        let max_model_len = max_model_len(
            args,
            profile.model.max_model_len,
            "the sim profile's max_model_len",
        )?;
        let choice = TokenChoice::new(text.config().vocab_size, text.tokenizer().eos_token_ids());
        let cost = profile.step_for(args.role.as_str()).clone();
        let model = SimModel::new(s.num_kv_blocks, cost, choice, lateness);
        Ok(Self {
            step_model: Box::new(model),
            text,
            kv_layout: sim::SIM_KV_LAYOUT.to_string(),
            kv_block_bytes: sim::block_bytes(),
            limits: EngineLimits {
                num_kv_blocks: s.num_kv_blocks,
                max_num_seqs: s.max_num_seqs,
                max_num_batched_tokens: s.max_num_batched_tokens,
                max_model_len: max_model_len.min(s.num_kv_blocks * BLOCK_SIZE),
            },
            link: Some(SimulatedLink {
                latency: Duration::from_secs_f64(profile.link.latency_us / 1e6),
                bytes_per_second: profile.link.bandwidth_gbytes_per_s * 1e9,
                kv_bytes_per_token: profile.model.kv_bytes_per_token,
            }),
            sim_profile: Some(profile.name),
        })
    }
}

/// `--max-model-len`, at most `most` (named `what` in the error), else `most`.
fn max_model_len(args: &WorkerArgs, most: usize, what: &str) -> Result<usize, ComputeError> {
    match args.max_model_len {
        Some(len) if len > most => Err(ComputeError::InvalidArgs(format!(
            "--max-model-len {len} exceeds {what} {most}"
        ))),
        Some(len) => Ok(len),
        None => Ok(most),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(argv: &[&str]) -> WorkerArgs {
        let argv = ["worker"].iter().chain(argv).copied();
        crate::args::WorkerCli::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn a_sim_worker_refuses_the_limits_its_profile_sets() {
        let path = Path::new("/nonexistent.gguf");
        for flag in [
            "--num-kv-blocks",
            "--max-num-seqs",
            "--max-num-batched-tokens",
        ] {
            let args = args(&["--sim", "h100-llama-3.1-8b", flag, "7"]);
            let err = Compute::load(&args, path, None).err().unwrap().to_string();
            assert!(err.contains(flag) && err.contains("--sim"), "{err}");
        }
        // Without them, it gets as far as the tokenizer's file.
        let err = Compute::load(&args(&["--sim", "h100-llama-3.1-8b"]), path, None)
            .err()
            .unwrap();
        assert!(matches!(err, ComputeError::Model(_)), "{err}");
    }
}
