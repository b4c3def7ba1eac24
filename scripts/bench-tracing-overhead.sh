#!/usr/bin/env bash
# What OpenTelemetry tracing costs the gateway (issue 27, part 1): pdserve's gateway in
# front of the peers harness's fake prefill/decode pair (../shared/peers; run
# `run_peers.sh` once so it has built them), with tracing off, on at 100 % and on at 1 %
# (parentbased_traceidratio), interleaved, exporting to the otlp_sink example. Per run:
# wrk at --conc with a short chat; req/s, latency percentiles and the gateway's CPU per
# request (from /proc). The sink runs on the same machine: its CPU is reported apart.
#
#   cargo build --release -p pdserve -p pdserve-telemetry --example otlp_sink
#   scripts/bench-tracing-overhead.sh [--conc 64] [--duration 10] [--repeat 3]
set -euo pipefail
conc=64 duration=10 repeat=3
while [ $# -gt 0 ]; do
  case $1 in
    --conc) conc=$2; shift 2 ;; --duration) duration=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
done
source "$(dirname "$0")/fake-pair.sh"
sink_bin=${OTLP_SINK:-$here/target/release/examples/otlp_sink}
[ -x "$sink_bin" ] || { echo "no sink at $sink_bin: cargo build --release -p pdserve-telemetry --example otlp_sink" >&2; exit 1; }
"$sink_bin" 18818 >/dev/null 2>&1 & sink=$!; pids+=($sink)
sleep 1
body='{"model": "fake-model", "messages": [{"role": "user", "content": "Give me three tips for staying healthy."}], "max_tokens": 16}'
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "| tracing | run | req/s | p50 ms | p90 ms | p99 ms | gateway CPU µs/req | sink CPU µs/req |"
echo "|---|---|---|---|---|---|---|---|"
for rep in $(seq 1 "$repeat"); do
  for mode in off on-100 on-1; do
    env=() extra=()
    case $mode in
      on-100) env=(OTEL_TRACES_SAMPLER=parentbased_always_on) ;;
      on-1) env=(OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.01) ;;
    esac
    [ "$mode" != off ] && extra=(--otlp-traces-endpoint http://127.0.0.1:18818/v1/traces)
    env "${env[@]}" "$bin" gateway --host 127.0.0.1 --port 18810 --prefill http://127.0.0.1:18801 \
      --decode http://127.0.0.1:18802 --probe-interval 0 --load-scrape-interval 0 "${extra[@]}" \
      >/dev/null 2>&1 &
    gw=$!
    for _ in $(seq 1 100); do curl -sf http://127.0.0.1:18810/health >/dev/null && break; sleep 0.1; done
    # Warm-up, then the measured run.
    WRK_BODY=$body wrk -t1 -c"$conc" -d2s -s "$peers/wrk_post.lua" http://127.0.0.1:18810/v1/chat/completions >/dev/null 2>&1
    before=$(cpu_ticks $gw) sink_before=$(cpu_ticks $sink)
    out=$(WRK_BODY=$body wrk -t1 -c"$conc" -d"${duration}s" -s "$peers/wrk_post.lua" http://127.0.0.1:18810/v1/chat/completions 2>/dev/null | tail -1)
    after=$(cpu_ticks $gw) sink_after=$(cpu_ticks $sink)
    kill -INT $gw; wait $gw 2>/dev/null || true
    python3 -c "
import json, os
r = json.loads('''$out''')
tick = os.sysconf('SC_CLK_TCK')
n = max(r['requests'], 1)
cpu_us = ($after - $before) / tick * 1e6 / n
sink_us = ($sink_after - $sink_before) / tick * 1e6 / n
p99 = r.get('p99_us', float('nan')) / 1000
print(f\"| $mode | $rep | {r['rps']:.0f} | {r['p50_us']/1000:.2f} | {r['p90_us']/1000:.2f} | {p99:.2f} | {cpu_us:.0f} | {sink_us:.0f} |\")"
  done
done
