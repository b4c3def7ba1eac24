//! `pdserve bench compare A.json B.json ...`: one column per run, each value with its
//! ratio to the first run's, and an optional SVG plot of all runs.

use std::fmt::Write as _;

use crate::args::CompareArgs;
use crate::metrics::{Distribution, Summary};
use crate::plot::write_plot;
use crate::report::BenchResult;
use crate::BenchError;

type Extract = fn(&Summary) -> Option<f64>;
type Describe = fn(&BenchResult) -> String;

fn stat(d: &Option<Distribution>, f: fn(&Distribution) -> f64) -> Option<f64> {
    d.as_ref().map(f)
}

/// The rows of the comparison: name and how to read it from a summary.
const ROWS: &[(&str, Extract)] = &[
    ("Successful requests", |s| Some(s.completed as f64)),
    ("Failed requests", |s| Some(s.failed as f64)),
    ("Total output tokens", |s| {
        Some(s.total_output_tokens as f64)
    }),
    ("Duration (s)", |s| Some(s.duration_s)),
    ("Request throughput (req/s)", |s| Some(s.request_throughput)),
    ("Goodput (req/s)", |s| s.goodput),
    ("Output throughput (tok/s)", |s| Some(s.output_throughput)),
    ("Total token throughput (tok/s)", |s| {
        Some(s.total_token_throughput)
    }),
    ("Cached prompt-token share (%)", |s| {
        s.cached_token_share.map(|v| v * 100.0)
    }),
    ("Mean TTFT (ms)", |s| stat(&s.ttft_ms, |d| d.mean)),
    ("P50 TTFT (ms)", |s| stat(&s.ttft_ms, |d| d.p50)),
    ("P90 TTFT (ms)", |s| stat(&s.ttft_ms, |d| d.p90)),
    ("P99 TTFT (ms)", |s| stat(&s.ttft_ms, |d| d.p99)),
    ("Mean TPOT (ms)", |s| stat(&s.tpot_ms, |d| d.mean)),
    ("P50 TPOT (ms)", |s| stat(&s.tpot_ms, |d| d.p50)),
    ("P99 TPOT (ms)", |s| stat(&s.tpot_ms, |d| d.p99)),
    ("Mean ITL (ms)", |s| stat(&s.itl_ms, |d| d.mean)),
    ("P50 ITL (ms)", |s| stat(&s.itl_ms, |d| d.p50)),
    ("P99 ITL (ms)", |s| stat(&s.itl_ms, |d| d.p99)),
    ("Mean E2E (ms)", |s| stat(&s.e2e_ms, |d| d.mean)),
    ("P50 E2E (ms)", |s| stat(&s.e2e_ms, |d| d.p50)),
    ("P99 E2E (ms)", |s| stat(&s.e2e_ms, |d| d.p99)),
    ("P99 send lateness (ms)", |s| {
        stat(&s.send_lateness_ms, |d| d.p99)
    }),
];

/// Run labels, made unique by appending `#2`, `#3`, ... to repeats.
fn unique_labels(runs: &[BenchResult]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(runs.len());
    for run in runs {
        let mut label = run.label.clone();
        let mut n = 1;
        while out.contains(&label) {
            n += 1;
            label = format!("{}#{n}", run.label);
        }
        out.push(label);
    }
    out
}

/// A number as an integer when it is one (counts), else with two decimals.
fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn cell(value: Option<f64>, base: Option<f64>, first: bool) -> String {
    match value {
        None => "-".into(),
        Some(v) if first => number(v),
        Some(v) => match base {
            Some(b) if b != 0.0 => format!("{} ({:.2}x)", number(v), v / b),
            _ => number(v),
        },
    }
}

/// Rows that say what each run was, without ratios.
fn setup_rows(runs: &[BenchResult]) -> Vec<Vec<String>> {
    let describe: [(&str, Describe); 4] = [
        ("Benchmark", |r| r.kind.name().to_string()),
        ("Model", |r| r.config.model.clone()),
        ("Load", |r| r.config.load_description()),
        ("Input / output tokens", |r| match &r.config.shared_prefix {
            Some(gsp) => format!(
                "{} shared + {} / {}",
                gsp.system_prompt_len, gsp.question_len, r.config.output_len
            ),
            None => format!("{} / {}", r.config.input_len, r.config.output_len),
        }),
    ];
    describe
        .iter()
        .map(|(name, f)| {
            std::iter::once(name.to_string())
                .chain(runs.iter().map(f))
                .collect()
        })
        .collect()
}

/// The side-by-side table of `runs` (ratios are value / first run's value).
pub fn table(runs: &[BenchResult]) -> String {
    let labels = unique_labels(runs);
    let mut grid: Vec<Vec<String>> = vec![std::iter::once("Metric".to_string())
        .chain(labels.iter().cloned())
        .collect()];
    grid.extend(setup_rows(runs));
    for (name, extract) in ROWS {
        let values: Vec<Option<f64>> = runs.iter().map(|r| extract(&r.summary)).collect();
        if values.iter().all(Option::is_none) {
            continue;
        }
        let mut row = vec![name.to_string()];
        row.extend(
            values
                .iter()
                .enumerate()
                .map(|(i, v)| cell(*v, values[0], i == 0)),
        );
        grid.push(row);
    }
    let widths: Vec<usize> = (0..grid[0].len())
        .map(|c| grid.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, row) in grid.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, text)| {
                if c == 0 {
                    format!("{text:<w$}", w = widths[c])
                } else {
                    format!("{text:>w$}", w = widths[c])
                }
            })
            .collect();
        let _ = writeln!(out, "{}", line.join(" | "));
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(out, "{}", rule.join("-+-"));
        }
    }
    out
}

/// Reads the files, prints the table and writes the plot if asked.
pub fn run_compare(args: &CompareArgs) -> Result<(), BenchError> {
    let runs = args
        .files
        .iter()
        .map(|p| BenchResult::read_json(p))
        .collect::<Result<Vec<_>, _>>()?;
    print!("{}", table(&runs));
    if let Some(path) = &args.plot {
        let labelled: Vec<(String, &BenchResult)> =
            unique_labels(&runs).into_iter().zip(runs.iter()).collect();
        write_plot(path, &labelled)?;
        tracing::info!(path = %path.display(), "plot written");
    }
    Ok(())
}
