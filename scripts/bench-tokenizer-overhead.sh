#!/usr/bin/env bash
# What `--tokenizer` costs the gateway (issue 26): pdserve's gateway in front of the
# peers harness's fake prefill/decode pair (../shared/peers; run `run_peers.sh` once so it
# has built them), without and with the model's tokenizer, interleaved. Per run: wrk at
# --conc with a chat of about --words words; the gateway's CPU per request (from
# /proc) and wrk's latency percentiles.
#
#   scripts/bench-tokenizer-overhead.sh [--words 1500] [--conc 1] [--duration 8] [--repeat 3] [--shared]
#
# --shared puts the words in a system message and asks a short question after it, as
# requests sharing a long system prompt do.
#
# Env: POLICY (the gateway's --policy for both runs, default round_robin; a policy that
# reads prompts, e.g. cache_aware, makes the tokenizer run on every request); DISTINCT=1
# numbers each request's prompt (scripts/wrk_distinct_chat.lua), so no two are the same;
# MODES (default "plain tokenizer"; also "uncached": --tokenizer with
# --tokenizer-cache-bytes 0) picks the gateways compared.
set -euo pipefail
words=1500 conc=1 duration=8 repeat=3 shared=0
while [ $# -gt 0 ]; do
  case $1 in
    --words) words=$2; shift 2 ;; --conc) conc=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;; --repeat) repeat=$2; shift 2 ;;
    --shared) shared=1; shift ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done
source "$(dirname "$0")/fake-pair.sh"
model=$("$bin" model fetch 2>/dev/null | tail -1)
sleep 1
body=$(python3 -c "
import json, random
random.seed(7)
vocab = 'the of and to in is was for on that with as by at from his her they this which or an be had are not but have one all were we when there can been has more if will who'.split()
text = ' '.join(random.choice(vocab) for _ in range($words))
messages = [{'role': 'user', 'content': text}]
if $shared:
    messages = [{'role': 'system', 'content': text}, {'role': 'user', 'content': 'What is this about?'}]
print(json.dumps({'model': 'fake-model', 'messages': messages, 'max_tokens': 16}))")
script=$peers/wrk_post.lua
[ "${DISTINCT:-0}" = 1 ] && script=$here/scripts/wrk_distinct_chat.lua
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "| gateway | run | req/s | p50 ms | p90 ms | CPU µs/req |"
echo "|---|---|---|---|---|---|"
for rep in $(seq 1 "$repeat"); do
  for mode in ${MODES:-plain tokenizer}; do
    case $mode in
      plain) extra=() ;;
      tokenizer) extra=(--tokenizer "$model") ;;
      uncached) extra=(--tokenizer "$model" --tokenizer-cache-bytes 0) ;;
      *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    "$bin" gateway --host 127.0.0.1 --port 18810 --prefill http://127.0.0.1:18801 \
      --decode http://127.0.0.1:18802 --probe-interval 0 --load-scrape-interval 0 --policy "${POLICY:-round_robin}" "${extra[@]}" \
      >/dev/null 2>&1 &
    gw=$!
    for _ in $(seq 1 100); do curl -sf http://127.0.0.1:18810/health >/dev/null && break; sleep 0.1; done
    # Warm-up, then the measured run.
    WRK_BODY=$body WRK_BASE=$peers/wrk_post.lua wrk -t1 -c"$conc" -d2s -s "$script" http://127.0.0.1:18810/v1/chat/completions >/dev/null 2>&1
    before=$(cpu_ticks $gw)
    out=$(WRK_BODY=$body WRK_BASE=$peers/wrk_post.lua wrk -t1 -c"$conc" -d"${duration}s" -s "$script" http://127.0.0.1:18810/v1/chat/completions 2>/dev/null | tail -1)
    after=$(cpu_ticks $gw)
    kill -INT $gw; wait $gw 2>/dev/null || true
    python3 -c "
import json, os
r = json.loads('''$out''')
tick = os.sysconf('SC_CLK_TCK')
cpu_us = ($after - $before) / tick * 1e6 / max(r['requests'], 1)
print(f\"| $mode | $rep | {r['rps']:.0f} | {r['p50_us']/1000:.2f} | {r['p90_us']/1000:.2f} | {cpu_us:.0f} |\")"
  done
done
