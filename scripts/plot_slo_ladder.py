#!/usr/bin/env python3
"""A small SVG of a ladder run (scripts/bench-slo.sh ladder): TTFT p90 per 5-second bin of
send time, one line per policy, heavy stages shaded. No plotting library needed.

    plot_slo_ladder.py OUT.svg PERIOD_S LABEL=RESULT.json...
"""
import json
import sys

COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]
W, H, L, R, T, B = 900, 380, 60, 170, 20, 40
BIN = 5.0


def p90(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def main():
    out, period, runs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    series = []
    span = 0.0
    for run in runs:
        label, path = run.split("=", 1)
        records = json.load(open(path))["requests"]
        bins = {}
        for r in records:
            if r["ok"] and r.get("ttft_ms") is not None:
                t = r.get("scheduled_s") or r["start_s"]
                bins.setdefault(int(t // BIN), []).append(r["ttft_ms"])
                span = max(span, t)
        series.append((label, sorted((k * BIN + BIN / 2, p90(v)) for k, v in bins.items())))
    top = max(v for _, pts in series for _, v in pts) * 1.1
    x = lambda t: L + (W - L - R) * t / span
    y = lambda v: H - B - (H - T - B) * v / top
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    start = 0.0
    while start < span:
        svg.append(f'<rect x="{x(start):.1f}" y="{T}" width="{x(min(start + period / 2, span)) - x(start):.1f}" height="{H - T - B}" fill="#eee"/>')
        start += period
    for k in range(0, 6):
        v = top * k / 5
        svg.append(f'<line x1="{L}" x2="{W - R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for k in range(0, int(span // 30) + 1):
        t = 30 * k
        svg.append(f'<text x="{x(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t}</text>')
    svg.append(f'<text x="{(L + W - R) / 2}" y="{H - 6}" text-anchor="middle">send time (s); shaded: heavy stages</text>')
    svg.append(f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" text-anchor="middle">TTFT p90 per {BIN:.0f} s (ms)</text>')
    for i, (label, pts) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        svg.append(f'<line x1="{W - R + 10}" x2="{W - R + 30}" y1="{T + 10 + 18 * i}" y2="{T + 10 + 18 * i}" stroke="{color}" stroke-width="2"/>')
        svg.append(f'<text x="{W - R + 36}" y="{T + 14 + 18 * i}">{label}</text>')
    svg.append("</svg>")
    open(out, "w").write("\n".join(svg))


if __name__ == "__main__":
    main()
