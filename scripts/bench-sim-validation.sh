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
# ENGINE=vllm makes the real runs real vLLM instead (scripts/vllm-cpu.sh), aggregated: two
# instances, one core each, behind `pdserve gateway` with up's policy and tokenizer,
# started for each real run and stopped after it; the sim runs are then
# `pdserve up --sim vllm-cpu-smollm2 --aggregated --workers 2`. Not P/D: vLLM's
# NixlConnector busy-polls on the instance's one core here, which halves its speed before
# any KV moves (docs/benchmarks.md, "The sim against real vLLM").
#
# Env: PDSERVE (binary, default target/release/pdserve), ENGINE (pdserve | vllm), PROFILE
# (cpu-smollm2, or vllm-cpu-smollm2 with ENGINE=vllm), PROMPTS (60), SLO_TTFT_MS and
# SLO_TPOT_MS (2000 / 50, or 3000 / 150 with ENGINE=vllm).
set -euo pipefail
out=${1:?usage: bench-sim-validation.sh OUT_DIR [SITTINGS] [RATES]}
sittings=${2:-3}
rates=${3:-"0.4 0.8"}
bin=${PDSERVE:-target/release/pdserve}
engine=${ENGINE:-pdserve}
case $engine in
  pdserve) profile=${PROFILE:-cpu-smollm2} slo_ttft=${SLO_TTFT_MS:-2000} slo_tpot=${SLO_TPOT_MS:-50} ;;
  # vLLM on one core steps a single sequence in ~60 ms: the README's 50 ms TPOT would
  # leave no goodput to compare.
  vllm) profile=${PROFILE:-vllm-cpu-smollm2} slo_ttft=${SLO_TTFT_MS:-3000} slo_tpot=${SLO_TPOT_MS:-150} ;;
  *) echo "ENGINE must be pdserve or vllm, not $engine" >&2; exit 2 ;;
esac
port=${PORT:-18780}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"

vllm=$here/vllm-cpu.sh
vllm_pair=(vval-a vval-b)
stop_vllm() { for name in "${vllm_pair[@]}"; do "$vllm" stop "$name" >/dev/null 2>&1 || true; done; }
[ "$engine" = vllm ] && trap stop_vllm EXIT

# Two real vLLM instances behind `pdserve gateway` with up's policy and tokenizer.
start_vllm_stack() { # log
  local a_port=$((port + 1)) b_port=$((port + 2))
  "$vllm" start vval-a "$a_port" 0 >/dev/null
  "$vllm" start vval-b "$b_port" 1 >/dev/null
  "$vllm" wait "$a_port" 300 vval-a
  "$vllm" wait "$b_port" 300 vval-b
  "$bin" gateway --host 127.0.0.1 --port "$port" --policy precise_prefix \
    --tokenizer "$("$bin" model fetch)" \
    --worker "http://127.0.0.1:$a_port" --worker "http://127.0.0.1:$b_port" >"$1" 2>&1 &
}

run_one() { # label seed rate up-args...
  local label=$1 seed=$2 rate=$3
  shift 3
  local up
  if [ "${1:-}" = vllm ]; then
    start_vllm_stack "$out/$label.up.log"
    up=$!
    wait_up "$port"
  else
    "$bin" up --port "$port" "$@" >"$out/$label.up.log" 2>&1 &
    up=$!
    wait_up "$port"
    wait_banner "$out/$label.up.log"
  fi
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "${PROMPTS:-60}" --input-len 384 --range-ratio 0.9 --output-len 64 \
    --request-rate "$rate" --seed "$seed" --slo-ttft-ms "$slo_ttft" --slo-tpot-ms "$slo_tpot" \
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
  [ "${1:-}" = vllm ] && stop_vllm
  return 0
}

for sitting in $(seq 1 "$sittings"); do
  for rate in $rates; do
    runs=(real sim)
    if [ $((sitting % 2)) -eq 0 ]; then runs=(sim real); fi
    for run in "${runs[@]}"; do
      label="$run-r$rate-s$sitting"
      case $run in
        real) if [ "$engine" = vllm ]; then run_one "$label" "$sitting" "$rate" vllm
              else run_one "$label" "$sitting" "$rate"; fi ;;
        sim) if [ "$engine" = vllm ]; then
               run_one "$label" "$sitting" "$rate" --sim "$profile" --aggregated --workers 2
             else run_one "$label" "$sitting" "$rate" --sim "$profile"; fi ;;
      esac
    done
  done
done
python3 "$here/sim_validation_table.py" "$out" | tee "$out/table.md"
