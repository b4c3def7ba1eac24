#!/usr/bin/env bash
# What the history store costs a Responses turn (issue 55): `pdserve up` (P/D) with each
# --history-backend, interleaved, on 20-turn `previous_response_id` chains
# (`pdserve bench multi-turn --api responses`, streamed, one conversation at a time).
# Per run: the result JSON (TTFT per turn), the gateway's history_seconds and its CPU time.
# A table: `scripts/history_table.py OUT_DIR`.
#
#   scripts/bench-history.sh OUT_DIR [SITTINGS] [RUNS]
#
# RUNS: names from "before memory sqlite postgres" (default: all). `before` is the build
# in $BEFORE (default target/keep/pdserve-before: the gateway kept chains in its memory,
# the workers stored the responses). Env: CONVERSATIONS (4), TURNS (20), PORT (18810),
# PG_PORT (18830).
set -euo pipefail
out=${1:?usage: bench-history.sh OUT_DIR [SITTINGS] [RUNS]}
sittings=${2:-3}
runs=${3:-"before memory sqlite postgres"}
bin=${PDSERVE:-target/release/pdserve}
before=${BEFORE:-target/keep/pdserve-before}
port=${PORT:-18810}
mkdir -p "$out"

here=$(dirname "$0")
# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"
# shellcheck source=lib/postgres.sh
source "$here/lib/postgres.sh"
trap 'pg_stop; kill $(jobs -p) 2>/dev/null || true' EXIT

# The CPU seconds process $1 has used.
cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }

run_one() { # label run seed
  local label=$1 run=$2 seed=$3 stack=("$bin" up) flags=()
  case $run in
    before) stack=("$before" up) ;;
    memory) flags=(--history-backend memory) ;;
    sqlite) flags=(--history-backend sqlite --history-url "$out/$label.sqlite") ;;
    postgres) pg_start "${PG_PORT:-18830}"; flags=(--history-backend postgres --history-url "$PG_URL") ;;
  esac
  "${stack[@]}" "${flags[@]}" --port "$port" >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  local gateway
  gateway=$(pgrep -P "$up" -f " gateway " | head -1)
  local cpu0
  cpu0=$(cpu_secs "$gateway")
  "$bin" bench multi-turn --url "http://127.0.0.1:$port" --api responses \
    --conversations "${CONVERSATIONS:-4}" --concurrency 1 --turns "${TURNS:-20}" \
    --input-len 256 --turn-input-len 16 --output-len 16 --seed "$seed" \
    --label "$label" --result-json "$out/$label.json" \
    >"$out/$label.bench.log" 2>&1 || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  awk -v a="$(cpu_secs "$gateway")" -v b="$cpu0" 'BEGIN { print a - b }' >"$out/$label.gateway_cpu"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pdserve_gateway_history_(seconds_(sum|count)|failures_total)' >"$out/$label.metrics" || true
  echo "$(date -u +%H:%M:%S) $label: gateway cpu $(cat "$out/$label.gateway_cpu") s; $(grep -E 'TTFT' "$out/$label.bench.log" | head -2 | tr -s ' ' | paste -sd';')" | tee -a "$out/progress.txt"
  kill -INT "$up"
  wait "$up" || true
  [ "$run" = postgres ] && pg_stop
  rm -f "$out/$label.sqlite" "$out/$label.sqlite-wal" "$out/$label.sqlite-shm"
}

read -r -a names <<<"$runs"
for sitting in $(seq 1 "$sittings"); do
  # Rotate the order each sitting, so no run always goes first.
  for i in $(seq 0 $((${#names[@]} - 1))); do
    run=${names[$(((i + sitting) % ${#names[@]}))]}
    run_one "$run-$sitting" "$run" "$sitting"
  done
done
python3 "$here/history_table.py" "$out" | tee "$out/table.md"
