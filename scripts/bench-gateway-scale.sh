#!/usr/bin/env bash
# How the gateway's cost grows with the fleet: the same trace replayed against
# `pdserve up --sim PROFILE` with 2, 8, 32 and 128 sim workers (half prefill, half decode;
# precise_prefix on their KV events, up's defaults), one after another, each by
# scripts/bench-sim-fleet.sh. Then a table of the gateway's CPU µs per request, its
# resident memory, its routing decision time (p50/p99 from
# pdserve_gateway_routing_decision_seconds), the KV events it ingested and the blocks it
# indexed, by fleet size: OUT_DIR/scale.md and OUT_DIR/scale.json.
#
#   scripts/bench-gateway-scale.sh OUT_DIR [SIZES] [RATE] [DURATION_S]
#   e.g. scripts/bench-gateway-scale.sh /tmp/scale "2 8 32 128" 4 90
#
# Env: PDSERVE (binary, default target/release/pdserve), PROFILE (h100-llama-3.1-8b),
# TRACE_ARGS (more `bench trace-gen` flags), UP_ARGS (more `pdserve up` flags).
set -euo pipefail
out=${1:?usage: bench-gateway-scale.sh OUT_DIR [SIZES] [RATE] [DURATION_S]}
sizes=${2:-2 8 32 128}
rate=${3:-4}
duration=${4:-90}
bin=${PDSERVE:-target/release/pdserve}
profile=${PROFILE:-h100-llama-3.1-8b}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

trace="$out/trace.jsonl"
# shellcheck disable=SC2086
"$bin" bench trace-gen --output "$trace" --duration-s "$duration" --request-rate "$rate" \
  --prefix-groups 64 --prefix-blocks 4 --prefix-zipf 1.0 --input-len 256 --output-len 64 \
  --range-ratio 0.5 --session-share 0.2 --session-turns 3 --think-time-s 5 --seed 7 \
  ${TRACE_ARGS:-}

for n in $sizes; do
  half=$((n / 2))
  # shellcheck disable=SC2086
  "$here/bench-sim-fleet.sh" "$out" "w$n" "$trace" 1 -- --sim "$profile" \
    --prefill "$half" --decode "$((n - half))" ${UP_ARGS:-}
done

python3 "$here/gateway_scale_table.py" "$out" $sizes
