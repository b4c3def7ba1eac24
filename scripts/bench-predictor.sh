#!/usr/bin/env bash
# The latency predictor's error (issue 54): `pdserve up` on the real engine (P/D) and on a
# simulated 4 + 4 H100 fleet, each serving random streamed completions at a steady rate;
# afterwards the gateway's pdserve_gateway_predictor_error_ratio{role,target} (the mean
# absolute percentage error of its last 256 predictions, each made before the outcome)
# and how many requests trained it. Send more than 256 + 50 requests so the window holds
# only predictions made after the model counted as trained.
#
#   scripts/bench-predictor.sh OUT_DIR [RUNS]
#
# RUNS: "real sim" (default). Env: PDSERVE (binary), REAL_PROMPTS (400), REAL_RATE (1.5),
# SIM_PROMPTS (800), SIM_RATE (16), PORT (18850).
set -euo pipefail
out=${1:?usage: bench-predictor.sh OUT_DIR [RUNS]}
runs=${2:-"real sim"}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18850}
mkdir -p "$out"
# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT

for run in $runs; do
  case $run in
    real) flags=(); prompts=${REAL_PROMPTS:-400}; rate=${REAL_RATE:-1.5} ;;
    sim) flags=(--sim h100-llama-3.1-8b --prefill 4 --decode 4); prompts=${SIM_PROMPTS:-800}; rate=${SIM_RATE:-16} ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
  "$bin" up "${flags[@]}" --port "$port" >"$out/$run.up.log" 2>&1 &
  up=$!
  wait_up "$port"
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "$prompts" --input-len 384 --range-ratio 0.9 --output-len 32 \
    --request-rate "$rate" --seed 5 --label "$run" --result-json "$out/$run.json" \
    >"$out/$run.bench.log" 2>&1 || echo "bench failed: $run" >&2
  curl -sf "http://127.0.0.1:$port/metrics" \
    | grep -E '^pdserve_gateway_(predictor_error_ratio|disaggregation_total)' >"$out/$run.metrics" || true
  echo "== $run: $prompts prompts at $rate req/s"
  grep -E 'Median TTFT|Mean TPOT' "$out/$run.bench.log" || true
  cat "$out/$run.metrics"
  kill -INT "$up"
  wait "$up" || true
done
