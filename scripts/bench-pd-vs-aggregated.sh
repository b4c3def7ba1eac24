#!/usr/bin/env bash
# P/D against aggregated on one box (issue 45's goal): `pdserve up` (P/D, its defaults),
# `pdserve up` with each extra P/D variant, and `pdserve up --aggregated`, interleaved, at
# each request rate, on the README's workload (streamed completions, 384 tokens ± 90 %
# in, 64 out, Poisson arrivals, SLO TTFT 2 s / TPOT 50 ms). One result JSON per run and
# a table of them (`pdserve bench compare`).
#
#   scripts/bench-pd-vs-aggregated.sh OUT_DIR [SITTINGS] [RATES]
#
# Env: PDSERVE (binary, default target/release/pdserve), PROMPTS (60), VARIANTS (extra
# P/D runs, `name=up flags` separated by `;`, e.g. "t512=--disagg-threshold 512"),
# BASELINE (another build's binary: one more P/D run, `pd-baseline`, with its defaults).
set -euo pipefail
out=${1:?usage: bench-pd-vs-aggregated.sh OUT_DIR [SITTINGS] [RATES]}
sittings=${2:-3}
rates=${3:-"0.4 0.6"}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18770}
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

run_one() { # label seed rate up-args...
  local label=$1 seed=$2 rate=$3 stack=$bin
  shift 3
  case $label in pd-baseline-*) stack=$BASELINE ;; esac
  "$stack" up --port "$port" "$@" >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "${PROMPTS:-60}" --input-len 384 --range-ratio 0.9 --output-len 64 \
    --request-rate "$rate" --seed "$seed" --slo-ttft-ms 2000 --slo-tpot-ms 50 \
    --label "$label" --result-json "$out/$label.json" >"$out/$label.bench.log" 2>&1 \
    || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  curl -sf "http://127.0.0.1:$port/metrics" | grep -E \
    '^pdserve_gateway_(first_token_from_prefill_total|disaggregation_total)' \
    | sed "s/^/$label: /" >>"$out/counts.txt" || true
  echo "$(date -u +%H:%M:%S) $label: $(grep -E 'Median TTFT|Request goodput|P99 ITL' "$out/$label.bench.log" | awk '{print $NF}' | paste -sd' ')" | tee -a "$out/progress.txt"
  kill -INT "$up"
  wait "$up" || true
}

IFS=';' read -r -a variants <<<"${VARIANTS:-}"
for sitting in $(seq 1 "$sittings"); do
  for rate in $rates; do
    # Alternate which stack runs first.
    runs=(pd aggregated)
    [ -n "${BASELINE:-}" ] && runs+=(pd-baseline)
    for v in "${variants[@]}"; do [ -n "$v" ] && runs+=("${v%%=*}"); done
    if [ $((sitting % 2)) -eq 0 ]; then runs=($(printf '%s\n' "${runs[@]}" | tac)); fi
    for run in "${runs[@]}"; do
      label="$run-r$rate-s$sitting"
      case $run in
        pd | pd-baseline) run_one "$label" "$sitting" "$rate" ;;
        aggregated) run_one "$label" "$sitting" "$rate" --aggregated ;;
        *)
          for v in "${variants[@]}"; do
            if [ "${v%%=*}" = "$run" ]; then
              read -r -a flags <<<"${v#*=}"
              run_one "$label" "$sitting" "$rate" "${flags[@]}"
            fi
          done ;;
      esac
    done
  done
done
"$bin" bench compare "$out"/*.json | tee "$out/table.md" || true
