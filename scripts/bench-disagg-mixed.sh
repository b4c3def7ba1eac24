#!/usr/bin/env bash
# Conditional disaggregation under load (issue 45, item 3): `pdserve up` P/D serving long
# prompts (the README's P/D workload, 0.4 req/s) and short ones (48 tokens ± 50 %,
# 0.5 req/s) at once, with the gateway's --disagg-threshold off, on only while the
# prefill worker is busy (--disagg-min-prefill-load 1), and on always; interleaved.
#
#   scripts/bench-disagg-mixed.sh OUT_DIR [REPEATS] [THRESHOLD]
#
# Env: PDSERVE (binary, default target/release/pdserve).
set -euo pipefail
out=${1:?usage: bench-disagg-mixed.sh OUT_DIR [REPEATS] [THRESHOLD]}
repeats=${2:-1}
threshold=${3:-64}
bin=${PDSERVE:-target/release/pdserve}
port=${PORT:-18760}
mkdir -p "$out"

# shellcheck source=lib/stack.sh
source "$(dirname "$0")/lib/stack.sh"

summary() { # label log
  printf '%s\t%s\n' "$1" "$(grep -E 'Median TTFT|P90 TTFT|P99 ITL|Request goodput' "$2" | awk '{print $NF}' | paste -sd' ')"
}

for rep in $(seq 1 "$repeats"); do
  modes=(off busy always)
  if [ $((rep % 2)) -eq 0 ]; then modes=(always busy off); fi
  for mode in "${modes[@]}"; do
    case $mode in
      off) args=(--gateway-arg=--disagg-threshold --gateway-arg=0) ;;
      busy) args=(--gateway-arg=--disagg-threshold "--gateway-arg=$threshold"
                  --gateway-arg=--disagg-min-prefill-load --gateway-arg=1) ;;
      always) args=(--gateway-arg=--disagg-threshold "--gateway-arg=$threshold"
                    --gateway-arg=--disagg-min-prefill-load --gateway-arg=0) ;;
    esac
    "$bin" up --port "$port" "${args[@]}" >"$out/$mode-$rep.up.log" 2>&1 &
    up=$!
    wait_up "$port"
    "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
      --num-prompts 30 --input-len 384 --range-ratio 0.9 --output-len 64 --request-rate 0.4 \
      --seed "$rep" --slo-ttft-ms 2000 --slo-tpot-ms 50 --label "long-$mode-$rep" \
      --result-json "$out/long-$mode-$rep.json" >"$out/long-$mode-$rep.log" 2>&1 &
    long=$!
    "$bin" bench serve --url "http://127.0.0.1:$port" --endpoint completions \
      --num-prompts 36 --input-len 48 --range-ratio 0.5 --output-len 32 --request-rate 0.5 \
      --seed "$((rep + 100))" --slo-ttft-ms 2000 --slo-tpot-ms 50 --label "short-$mode-$rep" \
      --result-json "$out/short-$mode-$rep.json" >"$out/short-$mode-$rep.log" 2>&1 || true
    wait "$long" || true
    local_prefills=$(curl -sf "http://127.0.0.1:$port/metrics" \
      | awk '/^pdserve_gateway_disaggregation_total/ {print}' | paste -sd' ')
    { summary "long-$mode-$rep" "$out/long-$mode-$rep.log"
      summary "short-$mode-$rep" "$out/short-$mode-$rep.log"
      echo "$mode-$rep: $local_prefills"; } | tee -a "$out/summary.tsv"
    kill -INT "$up"
    wait "$up" || true
  done
done
