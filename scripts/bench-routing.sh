#!/usr/bin/env bash
# Routing on the engines' own signals, measured (issue 26): `pdserve up` on the embedded
# model with two workers (aggregated, or P/D with two prefill workers), one gateway or two
# replicas, and round_robin / cache_aware on its approximate tree / precise_prefix on the
# workers' KV events, under SGLang's generated-shared-prefix workload spread over the
# replicas. One result JSON per run, its gateway's disaggregation counts (LABEL.counts),
# and a table of them (`pdserve bench compare`).
# The default shape — 16 groups sharing 768-token system prompts — is a working set
# (12k tokens) that fits the two workers' caches (8k tokens each) only when each group
# stays on one worker, as llm-d's published run is shaped against its pods.
#
#   scripts/bench-routing.sh OUT_DIR [REPEATS]
#
# Env: PDSERVE (binary, default target/release/pdserve), GSP_GROUPS (16), PER_GROUP (12),
# SYSTEM_LEN (768), QUESTION_LEN (48), OUTPUT_LEN (8), CONCURRENCY (8), TOPOLOGIES
# ("aggregated pd"; `up` is `pdserve up`'s own P/D layout), REPLICAS ("1 2"), POLICIES
# ("round_robin cache_aware precise_prefix"; `default` gives no --policy), UP_ARGS (more
# `pdserve up` flags for every run, e.g. "--disagg-threshold 0"), SEED_ONLY (run only this
# seed, once).
set -euo pipefail
out=${1:?usage: bench-routing.sh OUT_DIR [REPEATS]}
repeats=${2:-1}
bin=${PDSERVE:-target/release/pdserve}
mkdir -p "$out"
port=${PORT:-18600}

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

run_one() { # topology replicas policy repeat
  local topology=$1 replicas=$2 policy=$3 rep=$4
  local label="${topology}-r${replicas}-${policy}-${rep}"
  local stack=(--port "$port" --gateway-replicas "$replicas")
  # `default`: whatever `pdserve up` routes with when no --policy is given.
  if [ "$policy" != default ]; then stack+=(--policy "$policy"); fi
  case $topology in
    aggregated) stack+=(--aggregated --workers 2) ;;
    pd) stack+=(--prefill 2 --decode 1) ;;
    up) ;; # `pdserve up`'s own P/D layout (one prefill, one decode worker)
  esac
  if [ "$policy" = cache_aware ]; then
    stack+=(--gateway-arg=--cache-source --gateway-arg=approximate)
  fi
  read -r -a extra <<<"${UP_ARGS:-}"
  "$bin" up "${stack[@]}" ${extra[@]+"${extra[@]}"} >"$out/$label.up.log" 2>&1 &
  local up=$!
  wait_up "$port"
  for r in $(seq 1 $((replicas - 1))); do wait_up $((port + r)); done
  local urls=()
  for r in $(seq 0 $((replicas - 1))); do urls+=(--url "http://127.0.0.1:$((port + r))"); done
  "$bin" bench serve "${urls[@]}" --dataset shared-prefix \
    --gsp-num-groups "${GSP_GROUPS:-16}" --gsp-prompts-per-group "${PER_GROUP:-12}" \
    --gsp-system-prompt-len "${SYSTEM_LEN:-768}" --gsp-question-len "${QUESTION_LEN:-48}" \
    --gsp-output-len "${OUTPUT_LEN:-8}" --concurrency "${CONCURRENCY:-8}" \
    --seed "$rep" --label "$label" --result-json "$out/$label.json" \
    >"$out/$label.bench.log" 2>&1 || echo "bench failed: $label (see $out/$label.bench.log)" >&2
  # How many requests skipped the prefill leg (conditional disaggregation).
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pdserve_gateway_disaggregation' \
    >"$out/$label.counts" || true
  kill -INT "$up"
  wait "$up" || true
  grep -E "cached|TTFT|throughput" "$out/$label.bench.log" | sed "s/^/$label: /" || true
}

# SEED_ONLY=N runs only seed N (one repeat).
for rep in ${SEED_ONLY:-$(seq 1 "$repeats")}; do
  for topology in ${TOPOLOGIES:-aggregated pd}; do
    for replicas in ${REPLICAS:-1 2}; do
      for policy in ${POLICIES:-round_robin cache_aware precise_prefix}; do
        run_one "$topology" "$replicas" "$policy" "$rep"
      done
    done
  done
done
"$bin" bench compare "$out"/*.json | tee "$out/table.md" || true
