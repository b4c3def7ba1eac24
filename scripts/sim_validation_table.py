#!/usr/bin/env python3
"""The sim-against-real table of scripts/bench-sim-validation.sh: for each rate and
sitting, the real run's and the sim run's TTFT p50 and p90, TPOT mean and goodput, and
sim/real ratios; then the ratios' spread over the sittings per rate, and the share of sim
steps that ended within 5 ms of their modelled time (lateness.txt).

    scripts/sim_validation_table.py OUT_DIR
"""
import glob
import json
import os
import re
import sys


def load(path):
    with open(path) as f:
        s = json.load(f)["summary"]
    return {
        "ttft_p50": (s.get("ttft_ms") or {}).get("p50"),
        "ttft_p90": (s.get("ttft_ms") or {}).get("p90"),
        "tpot_mean": (s.get("tpot_ms") or {}).get("mean"),
        "goodput": s.get("goodput"),
        "failed": s.get("failed"),
    }


def main():
    out = sys.argv[1]
    runs = {}
    for path in glob.glob(os.path.join(out, "*.json")):
        m = re.match(r"(real|sim)-r([0-9.]+)-s(\d+)\.json$", os.path.basename(path))
        if m:
            runs[(m.group(1), m.group(2), int(m.group(3)))] = load(path)
    keys = ["ttft_p50", "ttft_p90", "tpot_mean", "goodput"]
    print("| rate | sitting | " + " | ".join(f"{k} real / sim (ratio)" for k in keys) + " |")
    print("|---" * (2 + len(keys)) + "|")
    ratios = {}
    for (kind, rate, sitting) in sorted(runs):
        if kind != "real" or ("sim", rate, sitting) not in runs:
            continue
        real, sim = runs[("real", rate, sitting)], runs[("sim", rate, sitting)]
        cells = []
        for k in keys:
            r, s = real[k], sim[k]
            if r and s is not None:
                ratios.setdefault((rate, k), []).append(s / r)
                cells.append(f"{r:.3g} / {s:.3g} ({s / r:.2f})")
            else:
                cells.append(f"{r} / {s}")
        print(f"| {rate} | {sitting} | " + " | ".join(cells) + " |")
    print()
    print("| rate | " + " | ".join(f"{k} sim/real" for k in keys) + " |")
    print("|---" * (1 + len(keys)) + "|")
    for rate in sorted({r for r, _ in ratios}):
        cells = []
        for k in keys:
            v = sorted(ratios.get((rate, k), []))
            cells.append(f"{v[len(v) // 2]:.2f} ({v[0]:.2f}-{v[-1]:.2f})" if v else "-")
        print(f"| {rate} | " + " | ".join(cells) + " |")
    late = os.path.join(out, "lateness.txt")
    if os.path.exists(late):
        within, count = 0.0, 0.0
        for line in open(late):
            parts = line.split()
            if "_count" in parts[2]:
                count += float(parts[-1])
            else:
                within += float(parts[-1])
        if count:
            print(f"\nsim steps within 5 ms of their modelled end: {within / count:.2%} of {count:.0f}")


if __name__ == "__main__":
    main()
