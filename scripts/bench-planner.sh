#!/usr/bin/env bash
# The P:D planner acting locally (issue 54, item 6): `pdserve up --sim h100-llama-3.1-8b
# --autoscale` from 1 prefill + 1 decode worker, against fixed P:D splits, on one ladder
# trace (light and heavy stages, each half of BURST_PERIOD_S). For each run: the share of
# requests in the SLO, goodput, and the worker-seconds it used (live workers in the
# gateway's /instances, sampled every second). Table: OUT_DIR/planner.md.
#
#   scripts/bench-planner.sh OUT_DIR [SPLITS]      SPLITS: "1+2 2+1 1+3 2+2 3+1" (P+D)
#
# Env: PDSERVE (binary), RATE (mean req/s, 15), DURATION_S (160), BURST_PERIOD_S (80),
# SLO_TTFT_MS (300), SLO_TPOT_MS (30), MAX_WORKERS (6), PORT (18820), AUTOSCALE_FROM (the
# P+D splits autoscaled runs start from, "1+1"; each is a run labelled autoscale-P+D).
set -euo pipefail
out=${1:?usage: bench-planner.sh OUT_DIR [SPLITS]}
splits=${2:-"1+2 2+1 1+3 2+2 3+1"}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18820}
ttft=${SLO_TTFT_MS:-300}
tpot=${SLO_TPOT_MS:-30}
period=${BURST_PERIOD_S:-80}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"
trace="$out/ladder.jsonl"
[ -f "$trace" ] || "$bin" bench trace-gen --output "$trace" --duration-s "${DURATION_S:-160}" \
  --request-rate "${RATE:-15}" --prefix-groups 16 --prefix-blocks 4 --prefix-zipf 1.2 \
  --input-len 2048 --output-len 128 --range-ratio 0.5 --session-share 0.2 --session-turns 3 \
  --think-time-s 5 --seed 5 --burst-factor 4 --burst-period-s "$period" --burst-fraction 0.5
objectives=(--gateway-arg=--slo-ttft-ms "--gateway-arg=$ttft" --gateway-arg=--slo-tpot-ms "--gateway-arg=$tpot")

run() { # LABEL UP_FLAGS...
  local label=$1
  shift
  "$bin" up --port "$port" --sim h100-llama-3.1-8b --policy slo "${objectives[@]}" "$@" \
    >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  wait_banner "$out/$label.up.log"
  sleep 2
  # Live workers every second, while the trace replays.
  (while true; do
     curl -sf "http://127.0.0.1:$port/instances" \
       | python3 -c 'import json,sys; r=json.load(sys.stdin); print(len(r["prefill"]["live"]), len(r["decode"]["live"]))' \
       || echo "0 0"
     sleep 1
   done) >"$out/$label.workers.txt" &
  local sampler=$!
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --dataset mooncake --dataset-path "$trace" --slo-ttft-ms "$ttft" --slo-tpot-ms "$tpot" \
    --label "$label" --result-json "$out/$label.json" >"$out/$label.bench.log" 2>&1 \
    || echo "bench failed: $label" >&2
  kill "$sampler" 2>/dev/null || true
  curl -sf "http://127.0.0.1:$port/planner" >"$out/$label.planner.json" || true
  kill -INT "$up"
  wait "$up" || true
}

labels=()
for from in ${AUTOSCALE_FROM:-1+1}; do
  run "autoscale-$from" --prefill "${from%+*}" --decode "${from#*+}" --autoscale \
    --max-workers "${MAX_WORKERS:-6}" --autoscale-interval-secs 2 --autoscale-cooldown-secs 5 \
    --gateway-arg=--planner-interval-secs --gateway-arg=1 \
    --gateway-arg=--planner-window-secs --gateway-arg=10
  labels+=("autoscale-$from")
done
for split in $splits; do
  run "fixed-$split" --prefill "${split%+*}" --decode "${split#*+}"
  labels+=("fixed-$split")
done

python3 - "$out" "$ttft" "$tpot" "${labels[@]}" <<'PY' | tee "$out/planner.md"
import json, sys
out, ttft, tpot, labels = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
print("| run | workers: mean (min–max) | worker-seconds | in SLO | goodput req/s | TTFT p50 / p90 ms |")
print("|---|---|---|---|---|---|")
for label in labels:
    try:
        r = json.load(open(f"{out}/{label}.json"))
    except OSError:
        continue
    recs = r["requests"]
    good = [x for x in recs if x["ok"] and x.get("ttft_ms") is not None and x["ttft_ms"] <= ttft
            and (x.get("tpot_ms") is None or x["tpot_ms"] <= tpot)]
    t = sorted(x["ttft_ms"] for x in recs if x["ok"] and x.get("ttft_ms") is not None)
    counts = [sum(map(int, l.split())) for l in open(f"{out}/{label}.workers.txt") if l.strip()]
    counts = [c for c in counts if c > 0] or [0]
    dur = r["summary"]["duration_s"]
    mean = sum(counts) / len(counts)
    print("| %s | %.2f (%d–%d) | %.0f | %.0f%% | %.2f | %.0f / %.0f |" % (
        label, mean, min(counts), max(counts), mean * dur, 100 * len(good) / len(recs),
        len(good) / dur, t[len(t) // 2], t[int(0.9 * len(t))]))
PY
