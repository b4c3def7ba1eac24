#!/usr/bin/env python3
"""The table of scripts/bench-history.sh's results: for each history backend, over its
sittings, TTFT p50 (all turns; and turns 1, 2, 10 and 20), the share of prompt tokens
served from cache, failures, the gateway's CPU per turn and the history store's calls.

    python3 scripts/history_table.py OUT_DIR
"""

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUNS = ["before", "memory", "sqlite", "postgres"]
TURNS = [0, 1, 9, 19]


def spread(values, fmt="{:.0f}"):
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def history_calls(path):
    """Mean ms per call and calls per op, from a /metrics excerpt."""
    sums, counts = {}, {}
    for line in path.read_text().splitlines() if path.exists() else []:
        m = re.match(r'pdserve_gateway_history_seconds_(sum|count)\{op="(\w+)"\} (\S+)', line)
        if m:
            (sums if m[1] == "sum" else counts)[m[2]] = float(m[3])
    return {op: (1000 * sums[op] / counts[op], counts[op]) for op in counts if counts[op]}


def main():
    out = Path(sys.argv[1])
    rows = defaultdict(lambda: defaultdict(list))
    for result in sorted(out.glob("*.json")):
        run = result.stem.rsplit("-", 1)[0]
        data = json.loads(result.read_text())
        summary = data["summary"]
        row = rows[run]
        row["ttft"].append(summary["ttft_ms"]["p50"])
        row["failed"].append(summary["failed"])
        row["cached"].append(100 * (summary.get("cached_token_share") or 0))
        for turn in data["turns"]:
            if turn["turn"] in TURNS and turn.get("ttft_ms"):
                row[f"t{turn['turn']}"].append(turn["ttft_ms"]["p50"])
        cpu = out / f"{result.stem}.gateway_cpu"
        if cpu.exists():
            row["cpu"].append(1000 * float(cpu.read_text()) / max(1, summary["completed"]))
        for op, (ms, _) in history_calls(out / f"{result.stem}.metrics").items():
            row[op].append(ms)
    print("| backend | sittings | TTFT p50, all turns (ms) | turn 1 | turn 2 | turn 10 | turn 20 "
          "| cached prompt | failed | gateway CPU per turn (ms) | history read (ms) | history write (ms) |")
    print("|---" * 12 + "|")
    for run in [r for r in RUNS if r in rows] + [r for r in rows if r not in RUNS]:
        row = rows[run]
        cells = [run, str(len(row["ttft"])), spread(row["ttft"])]
        cells += [spread(row[f"t{t}"]) for t in TURNS]
        cells += [spread(row["cached"], "{:.0f} %"), str(sum(row["failed"])),
                  spread(row["cpu"], "{:.2f}"), spread(row["read"], "{:.2f}"),
                  spread(row["write"], "{:.2f}")]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
