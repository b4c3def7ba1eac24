#!/usr/bin/env bash
# `pdserve up` on a machine doing other work (issue 56): each stack in RUNS, interleaved,
# under a busy neighbour (two `python3` busy loops at nice 0, started once the stack is up)
# and on a quiet machine, on the issue's workload (streamed completions, 20 prompts at
# concurrency 2, 256 tokens in, 32 out). One result JSON per run, a progress line each,
# and a table (`scripts/busy_neighbour_table.py OUT_DIR`).
#
#   scripts/bench-busy-neighbour.sh OUT_DIR [SITTINGS] [CONDITIONS]
#
# CONDITIONS: "busy quiet" (default). Env: RUNS, `name=command` separated by `;` (default:
# "pd=target/release/pdserve up;aggregated=target/release/pdserve up --aggregated"; a
# command may start with `nice -n 10`, or name another build), PROMPTS (20), PORT (18790),
# HOGS (2: busy processes in the neighbour).
set -euo pipefail
out=${1:?usage: bench-busy-neighbour.sh OUT_DIR [SITTINGS] [CONDITIONS]}
sittings=${2:-2}
conditions=${3:-"busy quiet"}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18790}
runs_spec=${RUNS:-"pd=$bin up;aggregated=$bin up --aggregated"}
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

hogs=()
start_neighbour() {
  for _ in $(seq 1 "${HOGS:-2}"); do
    python3 -c "while True: pass" &
    hogs+=($!)
  done
}
stop_neighbour() {
  for h in "${hogs[@]}"; do kill "$h" 2>/dev/null || true; done
  for h in "${hogs[@]}"; do wait "$h" 2>/dev/null || true; done
  hogs=()
}
trap 'stop_neighbour; kill $(jobs -p) 2>/dev/null || true' EXIT

run_one() { # label condition seed command...
  local label=$1 condition=$2 seed=$3
  shift 3
  "$@" --port "$port" >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  [ "$condition" = busy ] && start_neighbour
  "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
    --num-prompts "${PROMPTS:-20}" --concurrency 2 --input-len 256 --output-len 32 \
    --seed "$seed" --label "$label" --result-json "$out/$label.json" \
    >"$out/$label.bench.log" 2>&1 || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  stop_neighbour
  echo "$(date -u +%H:%M:%S) $label: $(grep -E 'Median TTFT|P90 TTFT|Max TTFT' "$out/$label.bench.log" | awk '{print $NF}' | paste -sd' ')" | tee -a "$out/progress.txt"
  kill -INT "$up"
  wait "$up" || true
}

IFS=';' read -r -a runs <<<"$runs_spec"
for sitting in $(seq 1 "$sittings"); do
  for condition in $conditions; do
    order=("${runs[@]}")
    # Alternate which stack runs first.
    if [ $((sitting % 2)) -eq 0 ]; then mapfile -t order < <(printf '%s\n' "${runs[@]}" | tac); fi
    for run in "${order[@]}"; do
      read -r -a command <<<"${run#*=}"
      run_one "${run%%=*}-$condition-s$sitting" "$condition" "$sitting" "${command[@]}"
    done
  done
done
python3 "$(dirname "$0")/busy_neighbour_table.py" "$out" | tee "$out/table.md"
