#!/usr/bin/env bash
# Serving to an SLO on a simulated H100 fleet (issue 54), each run a `pdserve up --sim`
# replaying a hot-prefix trace (scripts/bench-sim-fleet.sh), the gateway told the
# objectives (--slo-ttft-ms, --slo-tpot-ms) whatever its policy:
#   ladder  4P+4D; the trace's rate alternates light and heavy stages (bursts of
#           BURST_FACTOR× for half of every BURST_PERIOD_S), as llm-d's benchmark does;
#           each of POLICIES once. Table per stage: OUT_DIR/ladder.md.
#   speeds  2P+2D; one trace replayed ever faster (SPEEDS), precise_prefix then slo at each
#           speed (bar N-slo-routing). Table: OUT_DIR/speeds.md.
#   shed    2P+2D at the last of SPEEDS, slo, half the requests at priority 1
#           (sheddable), half at 0. Table: OUT_DIR/shed.md.
#
#   scripts/bench-slo.sh OUT_DIR [MODES]          MODES: "ladder speeds shed" (default)
#
# Env: PDSERVE (binary), SLO_TTFT_MS (300), SLO_TPOT_MS (30), LADDER_RATE (mean req/s,
# 16), SPEED_RATE (4), SPEEDS ("1 1.5 2 3"), DURATION_S (120), POLICIES ("slo
# precise_prefix power_of_two cache_aware"), BURST_FACTOR (4), BURST_PERIOD_S (30),
# INPUT_LEN (each request's own prompt tokens after its shared prefix, 2048), OUTPUT_LEN
# (128), TOKENIZE_PROMPT (1: the bench sends token ids, so nothing in the stack tokenizes
# the prompts and heavier stages fit on this machine).
set -euo pipefail
out=${1:?usage: bench-slo.sh OUT_DIR [MODES]}
modes=${2:-"ladder speeds shed"}
bin=${PDSERVE:-target/release/pdserve}
here=$(cd "$(dirname "$0")" && pwd)
ttft=${SLO_TTFT_MS:-300}
tpot=${SLO_TPOT_MS:-30}
duration=${DURATION_S:-120}
period=${BURST_PERIOD_S:-30}
policies=${POLICIES:-slo precise_prefix power_of_two cache_aware}
speeds=${SPEEDS:-1 1.5 2 3}
mkdir -p "$out"
export PDSERVE="$bin"
export BENCH_ARGS="--slo-ttft-ms $ttft --slo-tpot-ms $tpot"
if [ "${TOKENIZE_PROMPT:-0}" = 1 ]; then
  BENCH_ARGS="$BENCH_ARGS --tokenize-prompt --tokenizer-gguf $("$bin" model fetch)"
fi
objectives=(--gateway-arg=--slo-ttft-ms "--gateway-arg=$ttft" --gateway-arg=--slo-tpot-ms "--gateway-arg=$tpot")

trace() { # FILE RATE [more trace-gen flags]
  local file=$1 rate=$2
  shift 2
  [ -f "$file" ] || "$bin" bench trace-gen --output "$file" --duration-s "$duration" \
    --request-rate "$rate" --prefix-groups 16 --prefix-blocks 4 --prefix-zipf 1.2 \
    --input-len "${INPUT_LEN:-2048}" --output-len "${OUTPUT_LEN:-128}" --range-ratio 0.5 --session-share 0.2 \
    --session-turns 3 --think-time-s 5 --seed 3 "$@"
}

for mode in $modes; do
  case $mode in
    ladder)
      trace "$out/ladder.jsonl" "${LADDER_RATE:-16}" --burst-factor "${BURST_FACTOR:-4}" \
        --burst-period-s "$period" --burst-fraction 0.5
      labels=()
      for policy in $policies; do
        "$here/bench-sim-fleet.sh" "$out" "ladder-$policy" "$out/ladder.jsonl" 1 -- \
          --sim h100-llama-3.1-8b --prefill 4 --decode 4 --policy "$policy" "${objectives[@]}"
        labels+=("ladder-$policy")
      done
      python3 "$here/slo_table.py" "$out" "${labels[@]}" --ttft "$ttft" --tpot "$tpot" \
        --period "$period" --fraction 0.5 | tee "$out/ladder.md"
      ;;
    speeds)
      trace "$out/speeds.jsonl" "${SPEED_RATE:-4}"
      labels=()
      for speed in $speeds; do
        for policy in precise_prefix slo; do
          "$here/bench-sim-fleet.sh" "$out" "x$speed-$policy" "$out/speeds.jsonl" "$speed" -- \
            --sim h100-llama-3.1-8b --prefill 2 --decode 2 --policy "$policy" "${objectives[@]}"
          labels+=("x$speed-$policy")
        done
      done
      python3 "$here/slo_table.py" "$out" "${labels[@]}" --ttft "$ttft" --tpot "$tpot" | tee "$out/speeds.md"
      ;;
    shed)
      trace "$out/speeds.jsonl" "${SPEED_RATE:-4}"
      fastest=${speeds##* }
      BENCH_ARGS="$BENCH_ARGS --priority 0:0.5 --priority 1:0.5" \
        "$here/bench-sim-fleet.sh" "$out" "shed-x$fastest" "$out/speeds.jsonl" "$fastest" -- \
        --sim h100-llama-3.1-8b --prefill 2 --decode 2 --policy slo "${objectives[@]}" \
        --worker-arg=--scheduling-policy --worker-arg=priority
      python3 "$here/slo_table.py" "$out" "shed-x$fastest" --ttft "$ttft" --tpot "$tpot" | tee "$out/shed.md"
      ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
