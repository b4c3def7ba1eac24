#!/usr/bin/env bash
# Routing policies on a shared-prefix trace at fleet scale (sim): each of round_robin,
# power_of_two, cache_aware and precise_prefix, on `pdserve up --sim PROFILE` as 8 prefill
# + 8 decode workers and as 16 aggregated ones, at each request rate given, replaying the
# same trace-gen trace per rate (scripts/bench-sim-fleet.sh each). Then one table of TTFT
# p50/p90, TPOT mean, goodput (--slo-ttft-ms / --slo-tpot-ms) and cached share:
# OUT_DIR/policies.md.
#
#   scripts/bench-sim-policies.sh OUT_DIR "RATES" [DURATION_S]
#   e.g. scripts/bench-sim-policies.sh /tmp/pol "4 8 12" 60
#
# Env: PDSERVE (binary), PROFILE (h100-llama-3.1-8b), SLO_TTFT_MS (200), SLO_TPOT_MS (50),
# POLICIES, TOPOLOGIES ("pd agg"), PREFIX_GROUPS (128: shared prefixes in the trace; fewer
# means fewer first-seen prefixes), SESSION_SHARE (0.2: the share of requests in multi-turn
# sessions, whose later turns bring new tokens), PREFIX_BLOCKS (8: 512-token blocks per
# prefix), TOKENIZE_PROMPT (1: the bench sends token ids, so nothing in the stack
# tokenizes the long prompts), TRACE_ARGS (more `bench trace-gen` flags).
set -euo pipefail
out=${1:?usage: bench-sim-policies.sh OUT_DIR "RATES" [DURATION_S]}
rates=${2:?rates, e.g. "4 8 12"}
duration=${3:-60}
bin=${PDSERVE:-target/release/pdserve}
profile=${PROFILE:-h100-llama-3.1-8b}
policies=${POLICIES:-round_robin power_of_two cache_aware precise_prefix}
topologies=${TOPOLOGIES:-pd agg}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export BENCH_ARGS="--slo-ttft-ms ${SLO_TTFT_MS:-200} --slo-tpot-ms ${SLO_TPOT_MS:-50}"
if [ "${TOKENIZE_PROMPT:-0}" = 1 ]; then
  BENCH_ARGS="$BENCH_ARGS --tokenize-prompt --tokenizer-gguf $("$bin" model fetch)"
fi

for rate in $rates; do
  trace="$out/trace-r$rate.jsonl"
  # shellcheck disable=SC2086
  [ -f "$trace" ] || "$bin" bench trace-gen --output "$trace" --duration-s "$duration" \
    --request-rate "$rate" --prefix-groups "${PREFIX_GROUPS:-128}" --prefix-blocks "${PREFIX_BLOCKS:-8}" --prefix-zipf 0.8 \
    --input-len 256 --output-len 64 --range-ratio 0.5 --session-share "${SESSION_SHARE:-0.2}" \
    --session-turns 3 --think-time-s 5 --seed 11 ${TRACE_ARGS:-}
  for topo in $topologies; do
    case $topo in
      pd) shape=(--prefill 8 --decode 8) ;;
      agg) shape=(--aggregated --workers 16) ;;
      *) echo "unknown topology $topo" >&2; exit 2 ;;
    esac
    for policy in $policies; do
      "$here/bench-sim-fleet.sh" "$out" "$topo-$policy-r$rate" "$trace" 1 -- \
        --sim "$profile" "${shape[@]}" --policy "$policy"
    done
  done
done

python3 - "$out" "$rates" "$topologies" "$policies" <<'PY' | tee "$out/policies.md"
import json, sys
out, rates, topologies, policies = sys.argv[1], *[a.split() for a in sys.argv[2:]]
print("| fleet | rate (req/s) | policy | requests (failed) | TTFT p50 ms | TTFT p90 ms | TPOT mean ms | goodput req/s (share in SLO) | cached share | within 5 ms (worst) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for topo in topologies:
    for rate in rates:
        for policy in policies:
            label = f"{topo}-{policy}-r{rate}"
            try:
                s = json.load(open(f"{out}/{label}.json"))["summary"]
                f = json.load(open(f"{out}/{label}.fleet.json"))
            except OSError:
                continue
            t, tp = s.get("ttft_ms") or {}, s.get("tpot_ms") or {}
            good = s.get("goodput") or 0.0
            share = s["good_requests"] / max(s["completed"], 1) if s.get("good_requests") is not None else None
            print("| %s | %s | `%s` | %d (%d) | %.0f | %.0f | %.1f | %.2f (%s) | %.2f | %s |" % (
                "8P+8D" if topo == "pd" else "16 aggregated", rate, policy, s["completed"],
                s["failed"], t.get("p50", 0), t.get("p90", 0), tp.get("mean", 0), good,
                "–" if share is None else "%.0f%%" % (100 * share),
                s.get("cached_token_share") or 0,
                "–" if f.get("worst_worker_within_5ms") is None else "%.2f%%" % (100 * f["worst_worker_within_5ms"])))
PY
