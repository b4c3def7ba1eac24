#!/usr/bin/env python3
"""Fits a sim profile's step costs to the real engine's own steps.

Input: Chrome traces written by `pdserve worker --profile-dir DIR` (POST /start_profile,
then /stop_profile), one or more per worker role. Every `step` event carries what the step
computed (prefill_tokens, prefill_attention_pairs, decode_tokens, decode_context_tokens)
and its duration (forward pass plus sampling). The fit is the sim's step formula
(crates/engine/src/sim/profile.rs) with weights_us = 0 (a CPU is compute-bound):

    dur_us = overhead + prefill_token * P + decode_token * D
             + prefill_attention_per_ktoken * pairs / 1000
             + decode_attention_per_ktoken * ctx / 1000

by least squares with every coefficient kept >= 0 (a coefficient that comes out negative
is fixed at 0 and the rest refitted). `step` is fitted on every trace together; each role
gets its own `role_step` fitted on its traces, where a role's steps do not exercise a term
(fewer than MIN_STEPS steps with it) that term comes from the common fit.

    scripts/fit-sim-profile.py --trace prefill=P.json --trace decode=D.json \
        --template crates/engine/sim-profiles/cpu-smollm2.yaml --out new.yaml

Everything but the `step` and `role_step` sections, and the header's fit lines, is kept
from the template (its leading comment lines up to "# Fitted" describe the engine).
Pure Python 3, no packages.
"""

import argparse
import datetime
import json
import platform
import re
import sys

TERMS = [
    "overhead_us",
    "prefill_token_us",
    "decode_token_us",
    "prefill_attention_us_per_ktoken",
    "decode_attention_us_per_ktoken",
]
MIN_STEPS = 20


def features(args):
    return [
        1.0,
        float(args["prefill_tokens"]),
        float(args["decode_tokens"]),
        float(args.get("prefill_attention_pairs", 0)) / 1000.0,
        float(args.get("decode_context_tokens", 0)) / 1000.0,
    ]


def read_steps(path):
    with open(path) as f:
        trace = json.load(f)
    steps = []
    for event in trace.get("traceEvents", []):
        if event.get("name") != "step" or "args" not in event:
            continue
        a = event["args"]
        if "prefill_attention_pairs" not in a:
            sys.exit(f"{path}: a step without prefill_attention_pairs: a trace from an older pdserve")
        steps.append((features(a), float(event["dur"])))
    if not steps:
        sys.exit(f"{path}: no step events (was the profiler started while requests ran?)")
    return steps


def solve(a, b):
    """Solves a x = b (small, dense) by Gaussian elimination with partial pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nonneg_lsq(steps, free, fixed, relative):
    """Least squares over the terms in `free` (indices), the others fixed at `fixed`; with
    `relative`, of each step's error relative to its time rather than in microseconds (for
    a designed sweep of a few steps from 70 ms to 5 s, where absolute errors would let the
    longest prefills set every term)."""
    free = list(free)
    while True:
        rows = []
        for x, y in steps:
            rest = sum(fixed[j] * x[j] for j in range(len(TERMS)) if j not in free)
            w = 1.0 / y if relative and y > 0 else 1.0
            rows.append(([x[j] * w for j in free], (y - rest) * w))
        k = len(free)
        ata = [[sum(r[0][i] * r[0][j] for r in rows) for j in range(k)] for i in range(k)]
        atb = [sum(r[0][i] * r[1] for r in rows) for i in range(k)]
        sol = solve(ata, atb) if k else []
        if sol is None:
            # A term that never varies: drop the last free one and try again.
            fixed[free.pop()] = 0.0
            continue
        coef = dict(fixed)
        for j, v in zip(free, sol):
            coef[j] = v
        negative = [j for j in free if coef[j] < 0]
        if not negative:
            return [coef[j] for j in range(len(TERMS))]
        worst = min(negative, key=lambda j: coef[j])
        free.remove(worst)
        fixed[worst] = 0.0


def quality(steps, coef):
    predicted = [sum(c * v for c, v in zip(coef, x)) for x, _ in steps]
    actual = [y for _, y in steps]
    mean = sum(actual) / len(actual)
    ss_res = sum((p - y) ** 2 for p, y in zip(predicted, actual))
    ss_tot = sum((y - mean) ** 2 for y in actual) or 1.0
    mape = sum(abs(p - y) / y for p, y in zip(predicted, actual) if y > 0) / len(actual)
    total_err = (sum(predicted) - sum(actual)) / sum(actual)
    return 1 - ss_res / ss_tot, mape, total_err


def fit_role(steps, common, relative):
    """A role's fit: terms its steps exercise are fitted, the rest taken from `common`."""
    used = {0}
    for j in range(1, len(TERMS)):
        if sum(1 for x, _ in steps if x[j] > 0) >= MIN_STEPS:
            used.add(j)
    fixed = {j: common[j] for j in range(len(TERMS)) if j not in used}
    return nonneg_lsq(steps, sorted(used), fixed, relative), used


def yaml_cost(coef, indent):
    pad = " " * indent
    values = dict(zip(TERMS, coef))
    lines = [f"{pad}overhead_us: {values['overhead_us']:.3f}", f"{pad}weights_us: 0"]
    lines += [f"{pad}{name}: {values[name]:.3f}" for name in TERMS[1:]]
    return "\n".join(lines)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True, metavar="ROLE=FILE",
                   help="a profiler trace of a worker of ROLE (prefill, decode, prefill_decode)")
    p.add_argument("--template", required=True, help="the profile whose other sections are kept")
    p.add_argument("--out", required=True, help="the profile to write")
    p.add_argument("--note", default="", help="a line for the header: how the traces were made")
    p.add_argument("--source", default="the real workers' profiler traces\n"
                   "# (scripts/fit-cpu-smollm2.sh makes them and refits on your machine).",
                   help="what the traces are, for the header")
    p.add_argument("--relative", action="store_true",
                   help="minimise each step's error relative to its time (for a few measured "
                   "steps of very different lengths) instead of in microseconds")
    args = p.parse_args()

    by_role = {}
    for spec in args.trace:
        role, _, path = spec.partition("=")
        if role not in ("prefill", "decode", "prefill_decode") or not path:
            sys.exit(f"--trace {spec}: expected ROLE=FILE with ROLE prefill, decode or prefill_decode")
        by_role.setdefault(role, []).extend(read_steps(path))

    everything = [s for steps in by_role.values() for s in steps]
    common = nonneg_lsq(everything, range(len(TERMS)), {}, args.relative)
    report = []
    r2, mape, total = quality(everything, common)
    report.append(f"#   step (all {len(everything)} steps): R^2 {r2:.3f}, mean abs error {mape:.1%}, total time {total:+.1%}")
    roles = {}
    for role, steps in sorted(by_role.items()):
        coef, used = fit_role(steps, common, args.relative)
        roles[role] = coef
        r2, mape, total = quality(steps, coef)
        fitted = ", ".join(TERMS[j] for j in sorted(used))
        report.append(f"#   role_step.{role} ({len(steps)} steps; fitted: {fitted}): R^2 {r2:.3f}, mean abs error {mape:.1%}, total time {total:+.1%}")

    with open(args.template) as f:
        template = f.read()
    body = re.split(r"^name:", template, maxsplit=1, flags=re.M)
    if len(body) != 2:
        sys.exit(f"{args.template}: no `name:` line")
    body = "name:" + body[1]
    # Drop the template's own step and role_step sections.
    body = re.sub(r"^(step|role_step):\n(?:(?:  .*|\s*#.*)?\n)*", "", body, flags=re.M)
    today = datetime.date.today().isoformat()
    # The template's own description: its leading comment lines, up to the last fit's.
    header = []
    for line in template.splitlines():
        if not line.startswith("#") or line.startswith("# Fitted "):
            break
        header.append(line)
    header += [
        f"# Fitted {today} on {cpu_model()} ({platform.machine()}) by",
        f"# scripts/fit-sim-profile.py from {args.source}",
    ]
    if args.note:
        header.append(f"# {args.note}")
    header.append("# Fit quality (per step, against the real engine's step time):")
    header.extend(report)
    out = "\n".join(header) + "\n" + body.rstrip("\n") + "\n"
    out += "step:\n" + yaml_cost(common, 2) + "\n"
    out += "role_step:\n"
    for role, coef in roles.items():
        out += f"  {role}:\n" + yaml_cost(coef, 4) + "\n"
    with open(args.out, "w") as f:
        f.write(out)
    print("\n".join(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
