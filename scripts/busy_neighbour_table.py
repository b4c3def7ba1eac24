#!/usr/bin/env python3
"""The table of a scripts/bench-busy-neighbour.sh run: per stack and condition, TTFT p50,
p90 and max and TPOT p50 of each sitting, and P/D's TTFT p90 over aggregated's per sitting.

    scripts/busy_neighbour_table.py OUT_DIR
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    runs = defaultdict(dict)  # (stack, condition) -> sitting -> summary
    for path in sorted(out.glob("*.json")):
        m = re.fullmatch(r"(.+)-(busy|quiet)-s(\d+)", path.stem)
        if not m:
            continue
        summary = json.loads(path.read_text())["summary"]
        runs[(m[1], m[2])][int(m[3])] = summary

    def ms(d, key):
        return f"{d[key] / 1000:.2f}" if d else "–"

    print("| stack | neighbour | sitting | TTFT p50 s | TTFT p90 s | TTFT max s | TPOT p50 ms | failed |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for (stack, condition), sittings in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for sitting, s in sorted(sittings.items()):
            ttft, tpot = s.get("ttft_ms"), s.get("tpot_ms")
            tp = f"{tpot['p50']:.0f}" if tpot else "–"
            print(f"| {stack} | {condition} | {sitting} | {ms(ttft, 'p50')} | {ms(ttft, 'p90')} "
                  f"| {ms(ttft, 'max')} | {tp} | {s.get('failed', 0)} |")
    print()
    print("TTFT p90 over aggregated's, same condition and sitting:")
    print()
    for (stack, condition), sittings in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if stack == "aggregated":
            continue
        base = runs.get(("aggregated", condition), {})
        ratios = [
            s["ttft_ms"]["p90"] / base[k]["ttft_ms"]["p90"]
            for k, s in sorted(sittings.items())
            if k in base and s.get("ttft_ms") and base[k].get("ttft_ms")
        ]
        if ratios:
            print(f"- {stack}, {condition}: " + ", ".join(f"{r:.2f}×" for r in ratios))


if __name__ == "__main__":
    main()
