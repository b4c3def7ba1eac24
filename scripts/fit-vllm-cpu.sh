#!/usr/bin/env bash
# Fits the `vllm-cpu-smollm2` sim profile to real vLLM on this machine: starts one vLLM
# instance on one core (scripts/vllm-cpu.sh, as each instance of a P/D pair runs), measures
# its prefill and decode steps from outside (scripts/measure-engine-steps.py), stops it,
# and fits the sim's step formula to them (scripts/fit-sim-profile.py, as cpu-smollm2).
#
#   scripts/fit-vllm-cpu.sh OUT_DIR [CORE]
#
# Writes OUT_DIR/vllm-cpu-smollm2.yaml; copy it over
# crates/engine/sim-profiles/vllm-cpu-smollm2.yaml (built-in profiles are compiled in) or
# pass the file to --sim. Env: PORT (18750), MEASURE_ARGS (more measure-engine-steps.py
# flags). Installs vLLM first if it is not (scripts/vllm-cpu.sh install).
set -euo pipefail
out=${1:?usage: fit-vllm-cpu.sh OUT_DIR [CORE]}
core=${2:-1}
port=${PORT:-18750}
here=$(cd "$(dirname "$0")" && pwd)
vllm=$here/vllm-cpu.sh
mkdir -p "$out"
out=$(cd "$out" && pwd)

"$vllm" install
model=$(basename "$("$vllm" model)")
trap '"$vllm" stop fit-vllm >/dev/null 2>&1 || true' EXIT
"$vllm" start fit-vllm "$port" "$core" >/dev/null
"$vllm" wait "$port" 300 fit-vllm
# shellcheck disable=SC2086
python3 "$here/measure-engine-steps.py" --url "http://127.0.0.1:$port" --model "$model" \
  --out "$out/steps.json" ${MEASURE_ARGS:-} | tee "$out/steps.log"
python3 "$here/fit-sim-profile.py" --trace "prefill_decode=$out/steps.json" \
  --template "$here/../crates/engine/sim-profiles/vllm-cpu-smollm2.yaml" \
  --out "$out/vllm-cpu-smollm2.yaml" --relative \
  --source "request timings measured by scripts/measure-engine-steps.py" \
  --note "Steps: vLLM 0.32.0 (scripts/vllm-cpu.sh) on core $core, prefill one request at a time, decode batches streamed together."
