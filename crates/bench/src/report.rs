//! The result of a run: its JSON file (schema in crates/bench/README.md) and the table
//! printed on stdout.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::args::{Api, Endpoint};
use crate::metrics::{Distribution, FailureCount, RequestRecord, Summary};
use crate::priority::PriorityClass;
use crate::priority_report::{self, PrioritySummary};
use crate::BenchError;

/// Version of the result-file schema; bumped on any change a reader could notice.
pub const SCHEMA_VERSION: u32 = 1;

/// Above this p99 send lateness (ms) the report says the open loop ran late: the client,
/// not only the server, shaped the load.
pub const LATE_P99_MS: f64 = 10.0;

/// Which benchmark produced a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// `pdserve bench serve`.
    Serve,
    /// `pdserve bench multi-turn`.
    MultiTurn,
}

impl RunKind {
    /// The name used in result files: `serve` or `multi_turn`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Serve => "serve",
            Self::MultiTurn => "multi_turn",
        }
    }
}

/// What was asked for. Fields that do not apply to a kind are `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Server base URL (the first, with several).
    pub url: String,
    /// Every base URL the load was spread over (absent in files written before
    /// repeated `--url`).
    #[serde(default)]
    pub urls: Vec<String>,
    /// serve: `random` or `shared-prefix` (absent in older files: random).
    #[serde(default)]
    pub dataset: Option<crate::args::Dataset>,
    /// shared-prefix: groups × prompts per group, system prompt and question tokens.
    #[serde(default)]
    pub shared_prefix: Option<SharedPrefixConfig>,
    /// Model requested.
    pub model: String,
    /// API called.
    pub endpoint: Endpoint,
    /// Requests planned (multi-turn: conversations × turns).
    pub num_requests: u64,
    /// Requests (serve) or conversations (multi-turn) in flight; `null` in rate mode.
    pub concurrency: Option<u64>,
    /// Poisson request rate, req/s; `null` in concurrency mode.
    pub request_rate: Option<f64>,
    /// Prompt tokens (multi-turn: of the first message).
    pub input_len: u64,
    /// Output tokens per request.
    pub output_len: u64,
    /// Length spread (serve).
    pub range_ratio: Option<f64>,
    /// Seed of prompts, lengths and arrivals.
    pub seed: u64,
    /// Whether `ignore_eos: true` was sent.
    pub ignore_eos: bool,
    /// TTFT SLO, ms.
    pub slo_ttft_ms: Option<f64>,
    /// TPOT SLO, ms.
    pub slo_tpot_ms: Option<f64>,
    /// Multi-turn: conversations.
    pub conversations: Option<u64>,
    /// Multi-turn: turns per conversation.
    pub turns: Option<u64>,
    /// Multi-turn: tokens of each later user message.
    pub turn_input_len: Option<u64>,
    /// Multi-turn: whether `conversation_id` was sent.
    pub send_conversation_id: Option<bool>,
    /// Multi-turn: the API the conversations spoke (absent for serve and in files
    /// written before `--api`, which always spoke chat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<Api>,
    /// Multi-turn: tokens of the system prompt every conversation shares (absent in
    /// files written before the option existed).
    #[serde(default)]
    pub system_prompt_len: Option<u64>,
    /// serve: `--priority`, value and share of each class (absent without it, and in
    /// files written before it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub priorities: Vec<PriorityClass>,
    /// serve `--dataset mooncake`: the trace replayed (absent otherwise, and in files
    /// written before trace replay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceConfig>,
    /// serve `--tokenize-prompt`: prompts went as token ids (absent when they went as
    /// text).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tokenize_prompt: bool,
}

impl RunConfig {
    /// How the load was paced, in words: `8 in flight`, `4 req/s`, `trace at 2x`.
    pub fn load_description(&self) -> String {
        match (&self.trace, self.concurrency, self.request_rate) {
            (Some(trace), _, _) => format!("trace at {}x", trace.speedup),
            (None, _, Some(rate)) => format!("{rate} req/s"),
            (None, Some(n), None) => format!("{n} in flight"),
            _ => "-".into(),
        }
    }
}

/// A replayed trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceConfig {
    /// The trace file (`--dataset-path`).
    pub path: String,
    /// `--trace-speedup`: timestamps were divided by it.
    pub speedup: f64,
    /// Requests read out of timestamp order (replayed sorted).
    pub out_of_order: u64,
    /// First to last planned send, seconds (after the speedup).
    pub span_s: f64,
    /// Share of the trace's prompt tokens an earlier request already sent as the same
    /// prefix: what an unbounded prefix cache could serve.
    pub reusable_token_share: Option<f64>,
}

/// The shape of a shared-prefix workload.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SharedPrefixConfig {
    /// Groups (tenants), each with its own system prompt.
    pub groups: u64,
    /// Prompts per group.
    pub prompts_per_group: u64,
    /// Tokens of each system prompt.
    pub system_prompt_len: u64,
    /// Tokens of each question.
    pub question_len: u64,
}

/// Per-turn figures of a multi-turn run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnSummary {
    /// The turn, from 0.
    pub turn: u64,
    /// Requests of this turn that completed.
    pub completed: u64,
    /// Requests of this turn that failed.
    pub failed: u64,
    /// Mean prompt tokens (server count where reported).
    pub mean_prompt_tokens: Option<f64>,
    /// Cached prompt tokens over prompt tokens, where usage reports both.
    pub cached_token_share: Option<f64>,
    /// Time to first token of this turn.
    pub ttft_ms: Option<Distribution>,
}

/// A whole result file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Which benchmark.
    pub kind: RunKind,
    /// `pdserve-bench <version>`.
    pub tool: String,
    /// Name of the run (`--label`, else the model).
    pub label: String,
    /// Start of the run, seconds since the Unix epoch.
    pub started_at_unix_s: u64,
    /// Whether Ctrl-C cut the run short.
    pub interrupted: bool,
    /// What was asked for.
    pub config: RunConfig,
    /// What it added up to.
    pub summary: Summary,
    /// Failures by reason, most frequent first.
    pub failures: Vec<FailureCount>,
    /// Multi-turn: one entry per turn (empty for serve).
    pub turns: Vec<TurnSummary>,
    /// serve `--priority`: one entry per class, "none" last (absent without it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_priority: Vec<PrioritySummary>,
    /// Every request that was sent and finished (or failed).
    pub requests: Vec<RequestRecord>,
}

impl BenchResult {
    /// Writes the result as pretty JSON.
    pub fn write_json(&self, path: &Path) -> Result<(), BenchError> {
        let text =
            serde_json::to_string_pretty(self).map_err(|e| BenchError::Json(e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| BenchError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// Reads a result file, refusing other schema versions.
    pub fn read_json(path: &Path) -> Result<Self, BenchError> {
        let bad = |reason: String| BenchError::Io {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        match value.get("schema_version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err(bad(format!(
                    "schema version {v}, this build reads {SCHEMA_VERSION}"
                )))
            }
            None => return Err(bad("not a pdserve bench result (no schema_version)".into())),
        }
        serde_json::from_value(value).map_err(|e| bad(format!("not a pdserve bench result: {e}")))
    }

    /// The report table.
    pub fn table(&self) -> String {
        let s = &self.summary;
        let c = &self.config;
        let mut out = String::new();
        let title = match self.kind {
            RunKind::Serve => " Serving Benchmark Result ",
            RunKind::MultiTurn => " Multi-turn Benchmark Result ",
        };
        let conversation_api = (self.kind == RunKind::MultiTurn).then(|| {
            match (c.api.unwrap_or_default(), c.send_conversation_id) {
                (Api::Chat, Some(true)) => "chat + conversation_id".to_string(),
                (api, _) => api.name().to_string(),
            }
        });
        // Values are right-aligned in a column wide enough for the longest text value.
        let slo = [("TTFT", c.slo_ttft_ms), ("TPOT", c.slo_tpot_ms)]
            .iter()
            .filter_map(|(n, v)| v.map(|v| format!("{n}≤{v}ms")))
            .collect::<Vec<_>>()
            .join(" ");
        let vw = [
            16,
            self.label.chars().count(),
            c.model.chars().count(),
            slo.chars().count(),
            conversation_api.as_deref().map_or(0, |a| a.chars().count()),
        ]
        .into_iter()
        .max()
        .unwrap_or(16)
            + 1;
        // The per-priority rows are wider than the name and value columns.
        let vw = if self.per_priority.is_empty() {
            vw
        } else {
            vw.max(priority_report::SECTION_WIDTH - 44)
        };
        let width = 44 + vw;
        let _ = writeln!(out, "{title:=^width$}");
        if self.interrupted {
            let _ = writeln!(out, "{:^width$}", "(interrupted: partial results)");
        }
        let row = |out: &mut String, name: &str, value: String| {
            let _ = writeln!(out, "{name:<44}{value:>vw$}");
        };
        row(&mut out, "Label:", self.label.clone());
        row(&mut out, "Model:", c.model.clone());
        row(&mut out, "Load:", c.load_description());
        if let Some(api) = conversation_api {
            row(&mut out, "API:", api);
        }
        row(&mut out, "Successful requests:", s.completed.to_string());
        row(&mut out, "Failed requests:", s.failed.to_string());
        if s.not_finished > 0 {
            row(
                &mut out,
                "Not finished (interrupted):",
                s.not_finished.to_string(),
            );
        }
        row(
            &mut out,
            "Benchmark duration (s):",
            format!("{:.2}", s.duration_s),
        );
        row(
            &mut out,
            "Total input tokens:",
            s.total_input_tokens.to_string(),
        );
        row(
            &mut out,
            "Total generated tokens:",
            s.total_output_tokens.to_string(),
        );
        row(
            &mut out,
            "Request throughput (req/s):",
            format!("{:.2}", s.request_throughput),
        );
        if let Some(goodput) = s.goodput {
            row(&mut out, "Goodput SLOs:", slo);
            if let Some(good) = s.good_requests {
                row(&mut out, "Requests meeting the SLOs:", good.to_string());
            }
            row(
                &mut out,
                "Request goodput (req/s):",
                format!("{goodput:.2}"),
            );
        }
        row(
            &mut out,
            "Output token throughput (tok/s):",
            format!("{:.2}", s.output_throughput),
        );
        row(
            &mut out,
            "Total token throughput (tok/s):",
            format!("{:.2}", s.total_token_throughput),
        );
        if let Some(share) = s.cached_token_share {
            row(
                &mut out,
                "Cached prompt-token share:",
                format!("{:.1}%", share * 100.0),
            );
        }
        if let Some(share) = c.trace.as_ref().and_then(|t| t.reusable_token_share) {
            row(
                &mut out,
                "Trace reusable prompt-token share:",
                format!("{:.1}%", share * 100.0),
            );
        }
        for (title, name, dist) in [
            ("Time to First Token", "TTFT", &s.ttft_ms),
            (
                "Time per Output Token (excl. 1st token)",
                "TPOT",
                &s.tpot_ms,
            ),
            ("Inter-token Latency", "ITL", &s.itl_ms),
            ("End-to-end Latency", "E2E", &s.e2e_ms),
        ] {
            let _ = writeln!(out, "{:-^width$}", format!(" {title} "));
            match dist {
                Some(d) => {
                    for (stat, v) in [
                        ("Mean", d.mean),
                        ("Median", d.p50),
                        ("P90", d.p90),
                        ("P99", d.p99),
                    ] {
                        row(&mut out, &format!("{stat} {name} (ms):"), format!("{v:.2}"));
                    }
                }
                None => row(&mut out, &format!("{name} (ms):"), "-".into()),
            }
        }
        if let Some(late) = &s.send_lateness_ms {
            let _ = writeln!(out, "{:-^width$}", " Send Lateness (actual - planned) ");
            for (stat, v) in [("Median", late.p50), ("P99", late.p99), ("Max", late.max)] {
                row(
                    &mut out,
                    &format!("{stat} lateness (ms):"),
                    format!("{v:.2}"),
                );
            }
            if late.p99 > LATE_P99_MS {
                // The bench could not keep to its schedule: the server saw less load,
                // later, than planned, and its latencies flatter it.
                let _ = writeln!(
                    out,
                    "{:^width$}",
                    format!("(LATE: p99 > {LATE_P99_MS} ms, the load fell behind plan)")
                );
            }
        }
        if !self.turns.is_empty() {
            let _ = writeln!(out, "{:-^width$}", " Per turn ");
            let _ = writeln!(
                out,
                "{:>5} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8}",
                "turn", "ok", "fail", "prompt", "TTFT p50", "TTFT p99", "cached"
            );
            for t in &self.turns {
                let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| {
                    v.map(f).unwrap_or_else(|| "-".into())
                };
                let _ = writeln!(
                    out,
                    "{:>5} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8}",
                    t.turn,
                    t.completed,
                    t.failed,
                    opt(t.mean_prompt_tokens, &|v| format!("{v:.0}")),
                    opt(t.ttft_ms.map(|d| d.p50), &|v| format!("{v:.2}")),
                    opt(t.ttft_ms.map(|d| d.p99), &|v| format!("{v:.2}")),
                    opt(t.cached_token_share, &|v| format!("{:.1}%", v * 100.0)),
                );
            }
        }
        if !self.per_priority.is_empty() {
            priority_report::write_section(&mut out, &self.per_priority, width);
        }
        if !self.failures.is_empty() {
            let _ = writeln!(out, "{:-^width$}", " Failures ");
            for f in &self.failures {
                let _ = writeln!(out, "{:>6} × {}", f.count, f.reason);
            }
        }
        let _ = writeln!(out, "{}", "=".repeat(width));
        out
    }
}
