#!/usr/bin/env bash
# KV that moves while prefill runs (issue 45, item 2), measured: the gap between a
# prefill's end and its decode's first step, with the workers' --kv-stream off (the read
# is served once the prefill published) and on (each block sent as its chunk is
# computed), interleaved. The stack is `pdserve up --protocol sglang` (the decode worker's
# read is waiting before the prefill ends) with prefill chunks of CHUNK tokens, on the
# README's P/D workload.
#
#   scripts/bench-kv-stream.sh OUT_DIR [REPEATS]
#
# Env: PDSERVE (binary), PROMPTS (30), RATE (0.4), CHUNK (128).
# Prints, per run: the prefill worker's pdserve_kv_stream_tail_seconds mean (last chunk
# computed -> reader confirmed every block), the decode worker's
# pdserve_kv_import_wait_seconds mean (last block here -> first step), and blocks streamed.
set -euo pipefail
out=${1:?usage: bench-kv-stream.sh OUT_DIR [REPEATS]}
repeats=${2:-2}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18780}
chunk=${CHUNK:-128}
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

mean() { # metrics-text family
  awk -v f="$2" '$1 == f"_sum" {s=$2} $1 == f"_count" {c=$2} END {if (c > 0) printf "%.1f ms (n=%d)", 1000*s/c, c; else print "none"}' <<<"$1"
}

for rep in $(seq 1 "$repeats"); do
  modes=(off on)
  if [ $((rep % 2)) -eq 0 ]; then modes=(on off); fi
  for mode in "${modes[@]}"; do
    label=stream-$mode-$rep
    PDSERVE_KV_STREAM=$mode "$bin" up --port "$port" --protocol sglang \
      --worker-arg=--max-num-batched-tokens "--worker-arg=$chunk" >"$out/$label.up.log" 2>&1 &
    up=$!
    wait_up "$port"
    "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
      --num-prompts "${PROMPTS:-30}" --input-len 384 --range-ratio 0.9 --output-len 64 \
      --request-rate "${RATE:-0.4}" --seed "$rep" --slo-ttft-ms 2000 --slo-tpot-ms 50 \
      --label "$label" --result-json "$out/$label.json" >"$out/$label.bench.log" 2>&1 \
      || echo "bench failed: $label" >&2
    prefill=$(grep -o 'prefill worker at http://[0-9.:]*' "$out/$label.up.log" | head -1 | awk '{print $NF}')
    decode=$(grep -o 'decode worker at http://[0-9.:]*' "$out/$label.up.log" | head -1 | awk '{print $NF}')
    p=$(curl -sf "$prefill/metrics"); d=$(curl -sf "$decode/metrics")
    streamed=$(awk '$1 == "pdserve_kv_transfer_blocks_streamed_total" {print $2}' <<<"$p")
    echo "$label: stream tail $(mean "$p" pdserve_kv_stream_tail_seconds), import wait $(mean "$d" pdserve_kv_import_wait_seconds), blocks streamed ${streamed:-0}, $(grep -E 'Median TTFT|Mean ITL' "$out/$label.bench.log" | awk '{print $NF}' | paste -sd' ')" | tee -a "$out/summary.txt"
    kill -INT "$up"
    wait "$up" || true
  done
done
