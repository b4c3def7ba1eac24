#!/usr/bin/env bash
# Where conditional disaggregation pays (issue 45, item 3): `pdserve up` P/D with every
# prompt handed off (`--disagg-threshold` unset) against the same stack with every prompt
# prefilled on the decode worker (`--disagg-threshold 1000000`), interleaved, for short
# prompt lengths. Two streams at a time, so that a prompt prefilled on the decode worker
# shows what it costs the other stream's inter-token latency.
#
#   scripts/bench-disagg-threshold.sh OUT_DIR [LENGTHS] [REPEATS]
#
# Env: PDSERVE (binary, default target/release/pdserve), PROMPTS (16 per run).
set -euo pipefail
out=${1:?usage: bench-disagg-threshold.sh OUT_DIR [LENGTHS] [REPEATS]}
lengths=${2:-"16 32 64 128 256"}
repeats=${3:-2}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18750}
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

for rep in $(seq 1 "$repeats"); do
  modes=(handoff local)
  if [ $((rep % 2)) -eq 0 ]; then modes=(local handoff); fi
  for mode in "${modes[@]}"; do
    # Every prompt handed off, or every prompt prefilled on the decode worker.
    args=(--gateway-arg=--disagg-threshold --gateway-arg=0)
    if [ "$mode" = local ]; then
      args=(--gateway-arg=--disagg-threshold --gateway-arg=1000000
            --gateway-arg=--disagg-min-prefill-load --gateway-arg=0)
    fi
    # Routing on the prefix would send repeats of a prompt where it is cached.
    "$bin" up --port "$port" --policy round_robin "${args[@]}" \
      >"$out/$mode-$rep.up.log" 2>&1 &
    up=$!
    wait_up "$port"
    for len in $lengths; do
      label=$mode-$len-$rep
      "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
        --num-prompts "${PROMPTS:-16}" --input-len "$len" --range-ratio 0 --output-len 32 \
        --concurrency 2 --seed "$rep" --label "$label" --result-json "$out/$label.json" \
        >"$out/$label.bench.log" 2>&1 || echo "bench failed: $label" >&2
      printf '%s\t%s\n' "$label" "$(grep -E 'Median TTFT|P99 ITL' "$out/$label.bench.log" | awk '{print $NF}' | paste -sd' ')"
    done | tee -a "$out/summary.tsv"
    kill -INT "$up"
    wait "$up" || true
  done
done
