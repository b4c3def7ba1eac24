#!/usr/bin/env bash
# Overload control, measured (issue 27, part 3): `pdserve up` (P/D, 1 prefill + 1 decode
# worker) first at a fixed concurrency to find its capacity, then under a Poisson load of
# RATE_FACTOR (2) times that capacity with half the requests at high priority (vLLM's
# `priority` -1) and half at normal (0), in three stacks:
#
#   control   gateway --max-concurrent-requests/--queue-size/--queue-timeout-secs, and
#             workers --scheduling-policy priority
#   engine    workers --scheduling-policy priority only (no gateway queue)
#   none      neither (fcfs workers; the classes are sent as 0 and none, which fcfs accepts,
#             so the rows still split the same requests)
#
# One result JSON per run and a table (`pdserve bench compare`); the per-priority rows
# (TTFT p50/p90/p99, 429/408 rejections) are in each run's log.
#
#   scripts/bench-overload.sh OUT_DIR [REPEATS]
#
# Env: PDSERVE (binary, default target/release/pdserve), INPUT_LEN (256), OUTPUT_LEN (32),
# DURATION_S (60: requests = rate x this), RATE_FACTOR (2), MAX_CONCURRENT (4),
# QUEUE_SIZE (32), QUEUE_TIMEOUT_S (15), STACKS ("control engine none").
set -euo pipefail
out=${1:?usage: bench-overload.sh OUT_DIR [REPEATS]}
repeats=${2:-1}
bin=${PDSERVE:-target/release/pdserve}
mkdir -p "$out"
port=${PORT:-18700}
input_len=${INPUT_LEN:-256}
output_len=${OUTPUT_LEN:-32}

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

# start_stack STACK: `pdserve up` with that stack's flags, in the background ($up).
start_stack() {
  local stack=(--port "$port" --prefill 1 --decode 1)
  case $1 in
    control)
      stack+=(--gateway-arg=--max-concurrent-requests "--gateway-arg=${MAX_CONCURRENT:-4}"
        --gateway-arg=--queue-size "--gateway-arg=${QUEUE_SIZE:-32}"
        --gateway-arg=--queue-timeout-secs "--gateway-arg=${QUEUE_TIMEOUT_S:-15}"
        --worker-arg=--scheduling-policy --worker-arg=priority) ;;
    engine) stack+=(--worker-arg=--scheduling-policy --worker-arg=priority) ;;
    none | capacity) ;;
    *) echo "unknown stack $1" >&2; return 1 ;;
  esac
  "$bin" up "${stack[@]}" >"$out/$1.up.log" 2>&1 &
  up=$!
  wait_up "$port"
}

stop_stack() {
  kill -INT "$up"
  wait "$up" || true
}

# Capacity: completed requests per second at a concurrency that keeps both workers busy.
start_stack capacity
"$bin" bench serve --url "http://127.0.0.1:$port" --num-prompts 48 --concurrency 8 \
  --input-len "$input_len" --output-len "$output_len" --label capacity \
  --result-json "$out/capacity.json" >"$out/capacity.bench.log" 2>&1
stop_stack
capacity=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['request_throughput'])" "$out/capacity.json")
rate=$(python3 -c "print(round(${RATE_FACTOR:-2} * $capacity, 3))")
requests=$(python3 -c "print(max(40, int($rate * ${DURATION_S:-60})))")
echo "capacity ${capacity} req/s; offering ${rate} req/s, ${requests} requests per run"

for rep in $(seq 1 "$repeats"); do
  for stack in ${STACKS:-control engine none}; do
    label="$stack-$rep"
    classes=(--priority -1:0.5 --priority 0:0.5)
    if [ "$stack" = none ]; then classes=(--priority 0:0.5); fi
    start_stack "$stack"
    "$bin" bench serve --url "http://127.0.0.1:$port" --num-prompts "$requests" \
      --request-rate "$rate" --input-len "$input_len" --output-len "$output_len" \
      "${classes[@]}" --seed "$rep" --label "$label" --result-json "$out/$label.json" \
      >"$out/$label.bench.log" 2>&1 || echo "bench failed: $label (see $out/$label.bench.log)" >&2
    stop_stack
    sed -n '/Per priority/,$p' "$out/$label.bench.log" | sed "s/^/$label: /"
  done
done
"$bin" bench compare "$out"/*-[0-9]*.json | tee "$out/table.txt"
