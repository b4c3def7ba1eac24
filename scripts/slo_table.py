#!/usr/bin/env python3
"""Tables for scripts/bench-slo.sh: per run, the share of requests within the SLO, goodput,
TTFT and TPOT, requests shed (429), the gateway's predictor error, and (for the ladder)
the same split into the trace's heavy (burst) and light stages.

    slo_table.py OUT_DIR LABEL... [--ttft MS --tpot MS] [--period S --fraction F]
"""
import argparse
import json
import os
import re


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def good(r, ttft, tpot):
    return (r["ok"] and r.get("ttft_ms") is not None and r["ttft_ms"] <= ttft
            and (r.get("tpot_ms") is None or r["tpot_ms"] <= tpot))


def stats(records, duration, ttft, tpot):
    ok = [r for r in records if r["ok"]]
    shed = [r for r in records if r.get("http_status") == 429]
    ttfts = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    tpots = [r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None]
    n_good = sum(1 for r in records if good(r, ttft, tpot))
    return {
        "sent": len(records),
        "ok": len(ok),
        "shed": len(shed),
        "failed": len(records) - len(ok) - len(shed),
        "in_slo": n_good / len(records) if records else 0.0,
        "goodput": n_good / duration if duration else 0.0,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p90": pct(ttfts, 0.9),
        "tpot_mean": sum(tpots) / len(tpots) if tpots else None,
    }


def predictor_errors(prom_path):
    errors = {}
    try:
        text = open(prom_path).read()
    except OSError:
        return errors
    for m in re.finditer(r'pdserve_gateway_predictor_error_ratio\{role="(\w+)",target="(\w+)"\} (\S+)', text):
        errors[f"{m.group(1)} {m.group(2)}"] = float(m.group(3))
    return errors


def fmt(v, spec="%.0f"):
    return "–" if v is None else spec % v


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("labels", nargs="+")
    p.add_argument("--ttft", type=float, required=True)
    p.add_argument("--tpot", type=float, required=True)
    p.add_argument("--period", type=float, default=0.0)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--speedup", type=float, default=1.0)
    a = p.parse_args()
    staged = a.period > 0
    head = "| run | sent | in SLO | goodput req/s | TTFT p50 / p90 ms | TPOT mean ms | shed (429) | failed | predictor error (P ttft, D ttft, D tpot) |"
    if staged:
        head += " heavy: in SLO, TTFT p50 / p90 | light: in SLO, TTFT p50 / p90 |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for label in a.labels:
        path = os.path.join(a.out, f"{label}.json")
        if not os.path.exists(path):
            continue
        result = json.load(open(path))
        records = result.get("requests") or []
        duration = result["summary"]["duration_s"]
        s = stats(records, duration, a.ttft, a.tpot)
        e = predictor_errors(os.path.join(a.out, f"{label}.gateway.prom"))
        errs = ", ".join(fmt(e.get(k), "%.2f") for k in ("prefill ttft", "decode ttft", "decode tpot"))
        row = "| %s | %d | %.0f%% | %.2f | %s / %s | %s | %d | %d | %s |" % (
            label, s["sent"], 100 * s["in_slo"], s["goodput"], fmt(s["ttft_p50"]), fmt(s["ttft_p90"]),
            fmt(s["tpot_mean"], "%.1f"), s["shed"], s["failed"], errs)
        if staged:
            period = a.period / a.speedup
            heavy = [r for r in records if ((r.get("scheduled_s") or r["start_s"]) % period) < a.fraction * period]
            light = [r for r in records if r not in heavy]
            for part in (heavy, light):
                ps = stats(part, duration, a.ttft, a.tpot)
                row += " %.0f%%, %s / %s |" % (100 * ps["in_slo"], fmt(ps["ttft_p50"]), fmt(ps["ttft_p90"]))
        print(row)
        prios = result.get("per_priority") or []
        if prios:
            parts = []
            for c in prios:
                sent = c["completed"] + c["failed"]
                parts.append("priority %s: %d of %d served, %d shed (429)" % (
                    c.get("priority"), c["completed"], sent, c.get("rejected_429", 0)))
            print("|  | " + "; ".join(parts) + " |" + " |" * (head.count("|") - 3))


if __name__ == "__main__":
    main()
