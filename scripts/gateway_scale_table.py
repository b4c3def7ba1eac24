#!/usr/bin/env python3
"""The table of scripts/bench-gateway-scale.sh: for each fleet size N, from OUT_DIR/wN.json
(the bench's result), OUT_DIR/wN.fleet.json (CPU and memory) and OUT_DIR/wN.gateway.prom
(the gateway's metrics after the replay), the gateway's CPU µs per completed request, its
resident memory, its routing decision time p50/p99 (interpolated within the histogram's
buckets, as Prometheus's histogram_quantile does), the KV events it ingested and the
blocks it held indexed. Writes OUT_DIR/scale.md and OUT_DIR/scale.json.

    scripts/gateway_scale_table.py OUT_DIR N...
"""
import json
import re
import sys

LINE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')


def samples(path):
    out = []
    for line in open(path):
        m = LINE.match(line.strip())
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def quantile(buckets, q):
    """buckets: [(upper bound, cumulative count)] sorted, the last +Inf."""
    total = buckets[-1][1]
    if total == 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def within(buckets, limit):
    """The share of observations in buckets whose upper bound is at most limit."""
    total = buckets[-1][1] if buckets else 0
    under = [count for upper, count in buckets if upper <= limit * (1 + 1e-9)]
    return (under[-1] / total) if total and under else None


def row(out, n):
    result = json.load(open(f"{out}/w{n}.json"))["summary"]
    fleet = json.load(open(f"{out}/w{n}.fleet.json"))
    prom = samples(f"{out}/w{n}.gateway.prom")
    merged = {}
    for name, labels, value in prom:
        if name == "pdserve_gateway_routing_decision_seconds_bucket":
            le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
            merged[le] = merged.get(le, 0.0) + value
    buckets = sorted(merged.items())
    decisions = buckets[-1][1] if buckets else 0
    events = sum(v for name, _, v in prom if name == "pdserve_gateway_kv_events_total")
    blocks = sum(v for name, _, v in prom if name == "pdserve_gateway_kv_index_blocks")
    completed = result["completed"]
    gateway_cpu_s = fleet["gateway"]["cores"] * fleet["wall_s"]
    us = lambda s: None if s is None else s * 1e6
    return {
        "workers": int(n),
        "completed": completed,
        "failed": result["failed"],
        "wall_s": fleet["wall_s"],
        "gateway_cores": fleet["gateway"]["cores"],
        "gateway_cpu_us_per_request": gateway_cpu_s * 1e6 / max(completed, 1),
        "gateway_rss_mib": fleet["gateway"]["rss_mib"],
        "worker_cores": fleet["worker"]["cores"],
        "routing_decisions": decisions,
        "routing_p50_us": us(quantile(buckets, 0.5)) if buckets else None,
        "routing_p99_us": us(quantile(buckets, 0.99)) if buckets else None,
        # The share at or under the last bound within issue 53's 50 µs goal (48 µs, or 32
        # in a histogram of doubling buckets from before 2026-12-07).
        "routing_share_within_50us": within(buckets, 50e-6),
        "kv_events": events,
        "kv_events_per_s": events / fleet["wall_s"],
        "blocks_indexed": blocks,
        "ttft_p50_ms": (result.get("ttft_ms") or {}).get("p50"),
        "cached_share": result.get("cached_token_share"),
        "worst_worker_within_5ms": fleet.get("worst_worker_within_5ms"),
    }


def main():
    out, sizes = sys.argv[1], sys.argv[2:]
    rows = [row(out, n) for n in sizes]
    json.dump(rows, open(f"{out}/scale.json", "w"), indent=1)
    base = rows[0]["gateway_cpu_us_per_request"]
    fmt = lambda v, f="%.0f": "–" if v is None else f % v
    lines = [
        "| workers | requests (failed) | gateway CPU µs/request (× smallest) | gateway RSS MiB "
        "| routing p50 / p99 µs (≤ 50 µs) | KV events (per s) | blocks indexed | TTFT p50 ms | cached "
        "| within 5 ms (worst) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| %s | %d (%d) | %.0f (%.2f×) | %.0f | %s / %s (%s) | %d (%.0f) | %d | %s | %s | %s |" % (
                r["workers"], r["completed"], r["failed"], r["gateway_cpu_us_per_request"],
                r["gateway_cpu_us_per_request"] / base, r["gateway_rss_mib"],
                fmt(r["routing_p50_us"], "%.1f"), fmt(r["routing_p99_us"], "%.1f"),
                fmt(None if r["routing_share_within_50us"] is None
                    else 100 * r["routing_share_within_50us"], "%.1f %%"),
                r["kv_events"], r["kv_events_per_s"], r["blocks_indexed"],
                fmt(r["ttft_p50_ms"]), fmt(r["cached_share"], "%.2f"),
                fmt(r["worst_worker_within_5ms"], "%.4f")))
    text = "\n".join(lines) + "\n"
    open(f"{out}/scale.md", "w").write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
