//! What `serve` sends and when: a closed loop at `--concurrency`, an open loop of Poisson
//! arrivals at `--request-rate`, or a trace (`--dataset mooncake --dataset-path FILE`)
//! replayed open loop at its own timestamps (`--trace-speedup` scales them). The flags
//! are checked together: exactly one pacing, and a trace brings its own.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{Args, FromArgMatches, ValueEnum};

use crate::arg_values::{checked_args, positive_finite, positive_rate};

/// Where `serve`'s prompts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// Distinct prompts of random words.
    Random,
    /// Groups of prompts sharing a long system prompt (SGLang's generated-shared-prefix).
    SharedPrefix,
    /// A trace in Mooncake's format (`--dataset-path`), replayed at its timestamps.
    Mooncake,
}

/// `serve`'s pacing and prompt source, checked: with [`Dataset::Mooncake`],
/// `dataset_path` is set and neither `concurrency` nor `request_rate` is; otherwise
/// exactly one of them is set and `dataset_path` is not.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    /// `--concurrency`: requests in flight (closed loop).
    pub concurrency: Option<u64>,
    /// `--request-rate`: mean Poisson rate, req/s (open loop).
    pub request_rate: Option<f64>,
    /// `--dataset`.
    pub dataset: Dataset,
    /// `--dataset-path`: the trace file (mooncake only).
    pub dataset_path: Option<PathBuf>,
    /// `--trace-speedup`: timestamps are divided by it (1 without a trace).
    pub trace_speedup: f64,
}

impl Load {
    /// The trace to replay and its speedup, with `--dataset mooncake`.
    pub fn trace(&self) -> Option<(&PathBuf, f64)> {
        match (self.dataset, &self.dataset_path) {
            (Dataset::Mooncake, Some(path)) => Some((path, self.trace_speedup)),
            _ => None,
        }
    }
}

/// The flags behind [`Load`], before the checks across them.
#[derive(Debug, Clone, Args)]
struct LoadFlags {
    /// Keep this many requests in flight (closed loop). Not with `--dataset mooncake`.
    #[arg(long, env = "PDSERVE_BENCH_CONCURRENCY", value_parser = clap::value_parser!(u64).range(1..))]
    concurrency: Option<u64>,
    /// Send requests as a Poisson process with this mean rate, in requests per second
    /// (open loop). Not with `--dataset mooncake`.
    #[arg(long, env = "PDSERVE_BENCH_REQUEST_RATE", value_parser = positive_rate)]
    request_rate: Option<f64>,
    /// The prompts: `random` (distinct random words, `--input-len`); `shared-prefix`
    /// (SGLang's generated-shared-prefix set: `--gsp-num-groups` groups of
    /// `--gsp-prompts-per-group` prompts, each a group's system prompt followed by its own
    /// question, in a seeded random order; `--num-prompts`, `--input-len`, `--output-len`
    /// and `--range-ratio` do not apply); or `mooncake`, a trace in Mooncake's format
    /// (`--dataset-path`) replayed open loop at its timestamps, so it takes neither
    /// `--concurrency` nor `--request-rate` (`--input-len`, `--output-len` and
    /// `--range-ratio` do not apply either: the trace has the lengths).
    #[arg(long, env = "PDSERVE_BENCH_DATASET", value_enum, default_value_t = Dataset::Random)]
    dataset: Dataset,
    /// mooncake: the trace, one JSON object per line with `timestamp` (ms),
    /// `input_length`, `output_length` and `hash_ids` (ids of 512-token prompt blocks;
    /// equal ids give equal prompt blocks). `pdserve bench trace-gen` writes such files.
    #[arg(long, env = "PDSERVE_BENCH_DATASET_PATH", value_name = "FILE")]
    dataset_path: Option<PathBuf>,
    /// mooncake: replay this many times faster (timestamps are divided by it; 0.5
    /// replays at half speed) [default: 1].
    #[arg(long, env = "PDSERVE_BENCH_TRACE_SPEEDUP", value_name = "X", value_parser = speedup)]
    trace_speedup: Option<f64>,
}

fn speedup(s: &str) -> Result<f64, String> {
    positive_finite(s, "the trace speedup")
}

fn usage(kind: ErrorKind, message: String) -> clap::Error {
    clap::Error::raw(kind, message + "\n")
}

impl Load {
    fn flags(&self) -> LoadFlags {
        LoadFlags {
            concurrency: self.concurrency,
            request_rate: self.request_rate,
            dataset: self.dataset,
            dataset_path: self.dataset_path.clone(),
            trace_speedup: (self.dataset == Dataset::Mooncake).then_some(self.trace_speedup),
        }
    }

    fn checked(flags: LoadFlags) -> Result<Self, clap::Error> {
        let pacing = match (flags.concurrency, flags.request_rate) {
            (Some(_), Some(_)) => Some("--concurrency and --request-rate"),
            (Some(_), None) => Some("--concurrency"),
            (None, Some(_)) => Some("--request-rate"),
            (None, None) => None,
        };
        if flags.dataset == Dataset::Mooncake {
            if flags.dataset_path.is_none() {
                return Err(usage(
                    ErrorKind::MissingRequiredArgument,
                    "--dataset mooncake needs --dataset-path FILE (the trace to replay)".into(),
                ));
            }
            if let Some(given) = pacing {
                return Err(usage(
                    ErrorKind::ArgumentConflict,
                    format!(
                        "{given} cannot be used with --dataset mooncake: a trace is replayed \
                         open loop at its own timestamps (scale them with --trace-speedup; \
                         check the PDSERVE_BENCH_CONCURRENCY and PDSERVE_BENCH_REQUEST_RATE \
                         environment variables)"
                    ),
                ));
            }
        } else {
            for (given, flag) in [
                (flags.dataset_path.is_some(), "--dataset-path"),
                (flags.trace_speedup.is_some(), "--trace-speedup"),
            ] {
                if given {
                    return Err(usage(
                        ErrorKind::ArgumentConflict,
                        format!("{flag} only applies to --dataset mooncake (trace replay)"),
                    ));
                }
            }
            match (flags.concurrency, flags.request_rate) {
                (None, None) => {
                    return Err(usage(
                        ErrorKind::MissingRequiredArgument,
                        "one of --concurrency N (closed loop) or --request-rate R (open loop) \
                         is required, or --dataset mooncake to replay a trace"
                            .into(),
                    ))
                }
                (Some(_), Some(_)) => {
                    return Err(usage(
                        ErrorKind::ArgumentConflict,
                        "--concurrency and --request-rate cannot be used together: pick a \
                         closed or an open loop"
                            .into(),
                    ))
                }
                _ => {}
            }
        }
        Ok(Self {
            concurrency: flags.concurrency,
            request_rate: flags.request_rate,
            dataset: flags.dataset,
            dataset_path: flags.dataset_path,
            trace_speedup: flags.trace_speedup.unwrap_or(1.0),
        })
    }
}

// Which flags a run needs depends on `--dataset`'s value, which clap's conflicts and
// groups cannot express.
checked_args!(Load, LoadFlags);

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        load: Load,
    }

    fn parse(args: &[&str]) -> Result<Load, String> {
        Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|c| c.load)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_trace_brings_its_own_pacing() {
        let load = parse(&["--dataset", "mooncake", "--dataset-path", "t.jsonl"]).unwrap();
        assert_eq!(load.trace(), Some((&PathBuf::from("t.jsonl"), 1.0)));
        let load = parse(&[
            "--dataset",
            "mooncake",
            "--dataset-path",
            "t.jsonl",
            "--trace-speedup",
            "2.5",
        ])
        .unwrap();
        assert_eq!(load.trace_speedup, 2.5);
        assert_eq!(
            (parse(&["--concurrency", "2"]).unwrap().trace()),
            None,
            "no trace without --dataset mooncake"
        );
    }

    #[test]
    fn conflicting_or_missing_pacing_is_a_clear_error() {
        for (args, expected) in [
            (
                &["--dataset", "mooncake"][..],
                "--dataset mooncake needs --dataset-path",
            ),
            (
                &[
                    "--dataset",
                    "mooncake",
                    "--dataset-path",
                    "t",
                    "--concurrency",
                    "4",
                ][..],
                "--concurrency cannot be used with --dataset mooncake",
            ),
            (
                &[
                    "--dataset",
                    "mooncake",
                    "--dataset-path",
                    "t",
                    "--request-rate",
                    "4",
                ][..],
                "--request-rate cannot be used with --dataset mooncake",
            ),
            (
                &["--concurrency", "1", "--dataset-path", "t"][..],
                "--dataset-path only applies to --dataset mooncake",
            ),
            (
                &["--request-rate", "1", "--trace-speedup", "2"][..],
                "--trace-speedup only applies",
            ),
            (&[][..], "one of --concurrency N"),
            (
                &["--concurrency", "1", "--request-rate", "2"][..],
                "cannot be used together",
            ),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(expected), "{args:?}: {err}");
        }
        for bad in ["0", "-1", "inf", "x"] {
            let flag = format!("--trace-speedup={bad}");
            let err = parse(&["--dataset", "mooncake", "--dataset-path", "t", &flag]).unwrap_err();
            assert!(err.contains("--trace-speedup"), "{bad}: {err}");
        }
    }
}
