#!/usr/bin/env python3
"""The plots of docs/benchmarks.md's "How the gateway's cost grows with the fleet":

- from scripts/bench-gateway-scale.sh's OUT_DIR/scale.json: the gateway's CPU µs per
  request, resident MiB and routing decision p50/p99 against the number of sim workers;
- from `pdserve bench kv-index --result-json` files: decision time p50/p99 against blocks
  indexed, one line per file (label: its prompt length).

Needs matplotlib (`pip install matplotlib`); writes SVG.

    scripts/plot_gateway_scale.py OUT.svg SCALE_JSON KV_INDEX_JSON...
"""
import json
import sys

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    out, scale_path, index_paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    scale = json.load(open(scale_path))
    fig, (cpu, route, index) = plt.subplots(1, 3, figsize=(15, 4.2))
    workers = [r["workers"] for r in scale]

    cpu.plot(workers, [r["gateway_cpu_us_per_request"] for r in scale], "o-", label="CPU µs / request")
    cpu.set_xscale("log", base=2)
    cpu.set_xlabel("sim workers (half prefill, half decode)")
    cpu.set_ylabel("gateway CPU µs per request")
    cpu.set_ylim(bottom=0)
    rss = cpu.twinx()
    rss.plot(workers, [r["gateway_rss_mib"] for r in scale], "s--", color="tab:orange", label="RSS MiB")
    rss.set_ylabel("gateway RSS MiB")
    rss.set_ylim(bottom=0)
    cpu.set_title("gateway cost per request, live sim fleet")
    lines = cpu.get_legend_handles_labels()
    more = rss.get_legend_handles_labels()
    cpu.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right")

    for key, style in (("routing_p50_us", "o-"), ("routing_p99_us", "s--")):
        route.plot(workers, [r[key] for r in scale], style, label=key.split("_")[1])
    route.set_xscale("log", base=2)
    route.set_xlabel("sim workers")
    route.set_ylabel("routing decision µs")
    route.set_ylim(bottom=0)
    route.set_title("routing decision, live sim fleet")
    route.legend()

    for path in index_paths:
        report = json.load(open(path))
        blocks = [l["blocks_indexed"] for l in report["lookups"]]
        label = "%d-token prompts" % report["prompt_tokens"]
        index.plot(blocks, [l["hit_us"]["p99"] for l in report["lookups"]], "o-", label=label + ", held, p99")
        index.plot(blocks, [l["miss_us"]["p99"] for l in report["lookups"]], "s--", label=label + ", new, p99")
    index.axhline(50, color="grey", lw=0.8, ls=":")
    index.set_xscale("log")
    index.set_xlabel("blocks indexed (%d workers)" % report["workers"])
    index.set_ylabel("precise_prefix decision µs")
    index.set_ylim(bottom=0)
    index.set_title("decision time vs blocks indexed (in process)")
    index.legend(fontsize=7)

    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
