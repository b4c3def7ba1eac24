#!/usr/bin/env bash
# One run of a simulated fleet: `pdserve up --sim ...` with the given flags, a trace in
# Mooncake's format replayed against it (`pdserve bench serve --dataset mooncake`), and
# what the fleet cost this machine: CPU cores used by the gateway and by the workers over
# the replay, their resident memory, and the share of sim steps that ended within 5 ms of
# their modelled time (the run is valid only when it is at least 99 % on every worker).
#
#   scripts/bench-sim-fleet.sh OUT_DIR LABEL TRACE [SPEEDUP] -- UP_FLAGS...
#   e.g. scripts/bench-sim-fleet.sh out pd8 trace.jsonl 1 -- --sim h100-llama-3.1-8b --prefill 4 --decode 4
#
# Writes OUT_DIR/LABEL.json (the bench's result), OUT_DIR/LABEL.fleet.json (CPU, memory,
# lateness), OUT_DIR/LABEL.gateway.prom (the gateway's metrics after the replay) and
# appends a line to OUT_DIR/fleet.txt. Env: PDSERVE (binary, default
# target/release/pdserve), PORT (18800), BENCH_ARGS (more `bench serve` flags).
set -euo pipefail
out=${1:?usage: bench-sim-fleet.sh OUT_DIR LABEL TRACE [SPEEDUP] -- UP_FLAGS...}
label=${2:?label}
trace=${3:?trace}
speedup=1
shift 3
if [ "${1:-}" != "--" ]; then speedup=$1; shift; fi
[ "${1:-}" = "--" ] && shift
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18800}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"

"$bin" up --port "$port" --ready-timeout-secs 600 "$@" >"$out/$label.up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
wait_up "$port"
wait_banner "$out/$label.up.log"
# The gateway waits for every worker before it starts; give the event subscriptions a moment.
sleep 2
before=$(python3 "$here/proc_tree_cpu.py" "$up")
t0=$(date +%s.%N)
# shellcheck disable=SC2086
"$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
  --dataset mooncake --dataset-path "$trace" --trace-speedup "$speedup" \
  --label "$label" --result-json "$out/$label.json" ${BENCH_ARGS:-} >"$out/$label.bench.log" 2>&1 \
  || echo "bench failed: $label (see $out/$label.bench.log)" >&2
t1=$(date +%s.%N)
after=$(python3 "$here/proc_tree_cpu.py" "$up")
curl -sf "http://127.0.0.1:$port/metrics" >"$out/$label.gateway.prom" || true
lateness=$(for url in $(grep -oE 'worker at http://[0-9.:]+' "$out/$label.up.log" | awk '{print $3}'); do
  curl -sf "$url/metrics" | grep -E '^pdserve_sim_step_lateness_seconds_(bucket\{le="0.005"\}|count)' \
    | awk -v u="$url" '{print u, $0}'
done)
python3 - "$out/$label.fleet.json" "$t0" "$t1" "$before" "$after" "$lateness" <<'PY'
import json, sys
path, t0, t1, before, after, lateness = sys.argv[1:]
wall = float(t1) - float(t0)
b, a = json.loads(before), json.loads(after)
fleet = {"wall_s": wall}
for kind in ("gateway", "worker"):
    fleet[kind] = {
        "cores": (a[kind]["cpu_s"] - b[kind]["cpu_s"]) / wall,
        "rss_mib": a[kind]["rss_mib"],
        "processes": a[kind]["processes"],
    }
fleet["cores_total"] = fleet["gateway"]["cores"] + fleet["worker"]["cores"]
workers = {}
for line in lateness.splitlines():
    url, series, value = line.split()[0], line.split()[1], float(line.split()[-1])
    w = workers.setdefault(url, {})
    w["count" if "_count" in series else "within_5ms"] = value
shares = [w["within_5ms"] / w["count"] for w in workers.values() if w.get("count")]
fleet["steps"] = sum(w.get("count", 0) for w in workers.values())
fleet["worst_worker_within_5ms"] = min(shares) if shares else None
fleet["all_within_5ms"] = (sum(w.get("within_5ms", 0) for w in workers.values()) / fleet["steps"]) if fleet["steps"] else None
json.dump(fleet, open(path, "w"), indent=1)
print(json.dumps(fleet))
PY
python3 - "$out/$label.json" "$out/$label.fleet.json" "$label" <<'PY' | tee -a "$out/fleet.txt"
import json, sys, time
result, fleet, label = sys.argv[1:]
try:
    s = json.load(open(result))["summary"]
    t = s.get("ttft_ms") or {}
    run = "completed %d failed %d ttft_p50 %.0f ms ttft_p90 %.0f ms cached %.2f" % (
        s["completed"], s["failed"], t.get("p50", 0), t.get("p90", 0),
        s.get("cached_token_share") or 0)
except (OSError, KeyError, ValueError):
    run = "no result"
f = json.load(open(fleet))
print("%s %s: %s; cores %.2f (gateway %.2f, workers %.2f), worst worker within 5 ms %s" % (
    time.strftime("%H:%M:%S", time.gmtime()), label, run, f["cores_total"],
    f["gateway"]["cores"], f["worker"]["cores"], f["worst_worker_within_5ms"]))
PY
