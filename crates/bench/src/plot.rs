//! SVG plots of one or more runs: CDFs of TTFT, ITL and end-to-end latency, and output
//! throughput over the run.

use std::error::Error;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::BenchResult;
use crate::BenchError;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), Box<dyn Error>>;

/// Bars of the throughput-over-time panel.
const THROUGHPUT_BINS: usize = 50;

/// Draws the runs, each under its label, into an SVG file at `path`.
pub fn write_plot(path: &Path, runs: &[(String, &BenchResult)]) -> Result<(), BenchError> {
    draw(path, runs).map_err(|e| BenchError::Io {
        path: path.to_path_buf(),
        reason: format!("cannot draw the plot: {e}"),
    })
}

fn draw(path: &Path, runs: &[(String, &BenchResult)]) -> DrawResult {
    let root = SVGBackend::new(path, (1280, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 2));
    let ttft = |r: &BenchResult| r.requests.iter().filter_map(|q| q.ttft_ms).collect();
    let itl = |r: &BenchResult| {
        r.requests
            .iter()
            .flat_map(|q| q.itl_ms.iter().copied())
            .collect()
    };
    let e2e = |r: &BenchResult| r.requests.iter().filter_map(|q| q.e2e_ms).collect();
    cdf_panel(&panels[0], "Time to first token (CDF)", runs, ttft)?;
    cdf_panel(&panels[1], "Inter-token latency (CDF)", runs, itl)?;
    cdf_panel(&panels[2], "End-to-end latency (CDF)", runs, e2e)?;
    throughput_panel(&panels[3], runs)?;
    root.present()?;
    Ok(())
}

/// Tableau 10: distinct, readable on white.
const COLORS: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

fn color(i: usize) -> RGBColor {
    let (r, g, b) = COLORS[i % COLORS.len()];
    RGBColor(r, g, b)
}

fn cdf_panel(
    area: &Area<'_>,
    title: &str,
    runs: &[(String, &BenchResult)],
    samples: impl Fn(&BenchResult) -> Vec<f64>,
) -> DrawResult {
    let series: Vec<(&str, Vec<f64>)> = runs
        .iter()
        .map(|(label, run)| {
            let mut v = samples(run);
            v.sort_by(f64::total_cmp);
            (label.as_str(), v)
        })
        .collect();
    let x_max = series
        .iter()
        .filter_map(|(_, v)| v.last().copied())
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.05;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..x_max, 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("ms")
        .y_desc("fraction")
        .draw()?;
    for (i, (label, values)) in series.iter().enumerate() {
        if values.is_empty() {
            continue;
        }
        let n = values.len() as f64;
        let points = values
            .iter()
            .enumerate()
            .map(|(k, x)| (*x, (k + 1) as f64 / n));
        let style = color(i).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points, style))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
}

/// Output tokens per second in equal time bins, from each content chunk's arrival
/// (a request's tokens are spread evenly over its chunks).
fn throughput_bins(run: &BenchResult, span_s: f64) -> Vec<(f64, f64)> {
    let width = span_s / THROUGHPUT_BINS as f64;
    let mut tokens = vec![0.0f64; THROUGHPUT_BINS];
    for r in run.requests.iter().filter(|r| r.ok) {
        let Some(ttft) = r.ttft_ms else { continue };
        let chunks = r.itl_ms.len() + 1;
        let per_chunk = r.output_tokens as f64 / chunks as f64;
        let mut at = r.start_s + ttft / 1e3;
        for k in 0..chunks {
            if k > 0 {
                at += r.itl_ms[k - 1] / 1e3;
            }
            let bin = ((at / width) as usize).min(THROUGHPUT_BINS - 1);
            tokens[bin] += per_chunk;
        }
    }
    // A run shorter than the longest one ends where it ended, not in a line at zero.
    tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| ((i as f64 + 0.5) * width, t / width))
        .filter(|(at, _)| *at <= run.summary.duration_s + width)
        .collect()
}

fn throughput_panel(area: &Area<'_>, runs: &[(String, &BenchResult)]) -> DrawResult {
    let span_s = runs
        .iter()
        .map(|(_, r)| r.summary.duration_s)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let series: Vec<(&str, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|(label, run)| (label.as_str(), throughput_bins(run, span_s)))
        .collect();
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption("Output throughput over time", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..span_s, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds into the run")
        .y_desc("tokens/s")
        .draw()?;
    for (i, (label, points)) in series.into_iter().enumerate() {
        let style = color(i).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points, style))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}
