#!/usr/bin/env bash
# The simulated engine against the real one (issue 53, item 5): `pdserve up` (P/D, its
# defaults, the real engine) and `pdserve up --sim PROFILE` (the same stack, every worker
# simulated), interleaved, on the README's P/D workload (streamed completions, 384 tokens
# ± 90 % in, 64 out, Poisson arrivals, SLO TTFT 2 s / TPOT 50 ms), at each rate. Writes one
# result JSON per run, each sim worker's step lateness, and a table of sim/real ratios
# (TTFT p50 and p90, TPOT mean, goodput) per sitting.
#
#   scripts/bench-sim-validation.sh OUT_DIR [SITTINGS] [RATES]
#
# Env: PDSERVE (binary, default target/release/pdserve), PROFILE (cpu-smollm2), PROMPTS (60).
set -euo pipefail
out=${1:?usage: bench-sim-validation.sh OUT_DIR [SITTINGS] [RATES]}
sittings=${2:-3}
rates=${3:-"0.4 0.8"}
bin=${PDSERVE:-target/release/pdserve}
profile=${PROFILE:-cpu-smollm2}
port=${PORT:-18780}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"

run_one() { # label seed rate up-args...
  local label=$1 seed=$2 rate=$3
  shift 3
  "$bin" up --port "$port" "$@" >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  wait_banner "$out/$label.up.log"
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "${PROMPTS:-60}" --input-len 384 --range-ratio 0.9 --output-len 64 \
    --request-rate "$rate" --seed "$seed" --slo-ttft-ms 2000 --slo-tpot-ms 50 \
    --label "$label" --result-json "$out/$label.json" >"$out/$label.bench.log" 2>&1 \
    || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  # Each worker's lateness histogram (sim workers only have one).
  for url in $(grep -oE 'worker at http://[0-9.:]+' "$out/$label.up.log" | awk '{print $3}'); do
    curl -sf "$url/metrics" | grep -E '^pdserve_sim_step_lateness_seconds_(bucket\{le="0.005"\}|count)' \
      | sed "s|^|$label $url |" >>"$out/lateness.txt" || true
  done
  echo "$(date -u +%H:%M:%S) $label: $(grep -E 'Median TTFT|Request goodput' "$out/$label.bench.log" | awk '{print $NF}' | paste -sd' ')" | tee -a "$out/progress.txt"
  kill -INT "$up"
  wait "$up" || true
}

for sitting in $(seq 1 "$sittings"); do
  for rate in $rates; do
    runs=(real sim)
    if [ $((sitting % 2)) -eq 0 ]; then runs=(sim real); fi
    for run in "${runs[@]}"; do
      label="$run-r$rate-s$sitting"
      case $run in
        real) run_one "$label" "$sitting" "$rate" ;;
        sim) run_one "$label" "$sitting" "$rate" --sim "$profile" ;;
      esac
    done
  done
done
python3 "$here/sim_validation_table.py" "$out" | tee "$out/table.md"
