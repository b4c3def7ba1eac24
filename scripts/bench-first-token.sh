#!/usr/bin/env bash
# The first token from prefill (issue 45), measured: `pdserve up` (P/D, its defaults) with
# the gateway's --first-token-from-prefill off and auto, interleaved, on the workload the
# README's P/D bench uses (`pdserve bench serve` streams: the first token from prefill
# applies to streams only).
# One result JSON per run and a table of them (`pdserve bench compare`).
#
#   scripts/bench-first-token.sh OUT_DIR [REPEATS] [RATE]
#
# Env: PDSERVE (binary, default target/release/pdserve), PROMPTS (60), MODES ("off auto"),
# AGGREGATED=1 adds `pdserve up --aggregated` to every repeat.
set -euo pipefail
out=${1:?usage: bench-first-token.sh OUT_DIR [REPEATS] [RATE]}
repeats=${2:-2}
rate=${3:-0.4}
bin=${PDSERVE:-target/release/pdserve}
mkdir -p "$out"
port=${PORT:-18700}

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

run_one() { # label repeat up-args...
  local label=$1-$2
  shift 2
  "$bin" up --port "$port" "$@" >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "${PROMPTS:-60}" --input-len 384 --range-ratio 0.9 --output-len 64 \
    --request-rate "$rate" --seed "$rep" --slo-ttft-ms 2000 --slo-tpot-ms 50 \
    --label "$label" --result-json "$out/$label.json" >"$out/$label.bench.log" 2>&1 \
    || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  local from_prefill
  from_prefill=$(curl -sf "http://127.0.0.1:$port/metrics" \
    | awk '/^pdserve_gateway_first_token_from_prefill_total/ {print $NF}')
  echo "$label: streams led by the prefill token: ${from_prefill:-none}" | tee -a "$out/counts.txt"
  kill -INT "$up"
  wait "$up" || true
}

for rep in $(seq 1 "$repeats"); do
  modes=(${MODES:-off auto})
  # Alternate which mode runs first.
  if [ $((rep % 2)) -eq 0 ]; then modes=($(printf '%s\n' "${modes[@]}" | tac)); fi
  for mode in "${modes[@]}"; do
    run_one "pd-$mode" "$rep" --gateway-arg=--first-token-from-prefill --gateway-arg="$mode"
  done
  if [ "${AGGREGATED:-0}" = 1 ]; then run_one aggregated "$rep" --aggregated; fi
done
"$bin" bench compare "$out"/*.json | tee "$out/table.md" || true
