#!/usr/bin/env bash
# Refits the `cpu-smollm2` sim profile on this machine: runs `pdserve up` (P/D, its
# defaults) with every worker's step profiler on, replays the README's P/D workload
# (streamed completions, 384 tokens ± 90 % in, 64 out, Poisson arrivals) at RATE, and
# fits the sim's step formula to the recorded steps, per role
# (scripts/fit-sim-profile.py).
#
#   scripts/fit-cpu-smollm2.sh OUT_DIR [RATE] [PROMPTS] [SEED]
#
# Writes OUT_DIR/cpu-smollm2.yaml; copy it over crates/engine/sim-profiles/cpu-smollm2.yaml
# (a built-in profile is compiled in) or pass the file to --sim. Env: PDSERVE (binary,
# default target/release/pdserve), PORT (18790).
set -euo pipefail
out=${1:?usage: fit-cpu-smollm2.sh OUT_DIR [RATE] [PROMPTS] [SEED]}
rate=${2:-0.8}
prompts=${3:-60}
seed=${4:-100}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18790}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/traces"
out=$(cd "$out" && pwd)

# shellcheck source=lib/stack.sh
source "$here/lib/stack.sh"

"$bin" up --port "$port" --worker-arg=--profile-dir --worker-arg="$out/traces" \
  >"$out/up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
wait_up "$port"
wait_banner "$out/up.log"
# `pdserve up` prints "<role> worker at <url> on ..." for each worker.
mapfile -t workers < <(grep -oE '^  (prefill|decode|prefill_decode) worker at http://[0-9.:]+' "$out/up.log" \
  | sed -E 's/^  ([a-z_]+) worker at (.*)$/\1=\2/')
[ ${#workers[@]} -gt 0 ] || { echo "no workers in $out/up.log" >&2; exit 1; }
for w in "${workers[@]}"; do curl -sf -X POST "${w#*=}/start_profile" >/dev/null; done
"$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
  --num-prompts "$prompts" --input-len 384 --range-ratio 0.9 --output-len 64 \
  --request-rate "$rate" --seed "$seed" --result-json "$out/bench.json" >"$out/bench.log" 2>&1
traces=()
for w in "${workers[@]}"; do
  path=$(curl -sf -X POST "${w#*=}/stop_profile" | python3 -c 'import json,sys; print(json.load(sys.stdin)["trace"])')
  traces+=(--trace "${w%%=*}=$path")
done
python3 "$here/fit-sim-profile.py" "${traces[@]}" \
  --template "$here/../crates/engine/sim-profiles/cpu-smollm2.yaml" --out "$out/cpu-smollm2.yaml" \
  --note "Traces: pdserve up (P/D), the README's P/D workload at $rate req/s, $prompts prompts, seed $seed."
