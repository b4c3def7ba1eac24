#!/usr/bin/env bash
# The gateway's live status page in a real browser (issue 27, part 2): starts `pdserve up`
# (P/D: PREFILL prefill + DECODE decode workers, cache_aware routing, --expose-routing),
# sends traffic with `pdserve bench serve` (shared-prefix prompts) in the background, opens /dashboard in headless
# Chromium (installed from Debian's packages where missing), saves a screenshot and the
# DOM, and checks from the DOM that every worker of /instances has a roster row
# (`data-worker="URL"`), every chart has points (`data-points` > 0 on its <svg>) and the
# request table lists requests. Also loads the decode worker's own /dashboard the same way.
# Stops everything it started; exits non-zero on a failed check. Not run in CI.
#
#   scripts/dashboard-check.sh [SCREENSHOT]      (default docs/dashboard.png)
#
# Env: PDSERVE_BIN (default target/release/pdserve, built when missing), PORT (a free one
# when unset), PREFILL (2), DECODE (1), TRAFFIC_S (seconds of traffic before the page is
# opened: 20), WORKER_SCREENSHOT (where the worker page's screenshot goes:
# docs/dashboard-worker.png).
set -euo pipefail
cd "$(dirname "$0")/.."
shot=${1:-docs/dashboard.png}
worker_shot=${WORKER_SCREENSHOT:-docs/dashboard-worker.png}
bin=${PDSERVE_BIN:-target/release/pdserve}
prefill=${PREFILL:-2}
decode=${DECODE:-1}
traffic_s=${TRAFFIC_S:-20}
work=$(mktemp -d)
pids=()

cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill -INT "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if [ ! -x "$bin" ]; then
  echo "building $bin (release, about 12 minutes on 2 cores)"
  nice -n 19 cargo build --release -p pdserve
fi
chromium=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium" ]; then
  echo "installing chromium from Debian's packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  chromium=$(command -v chromium)
fi
port=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
url="http://127.0.0.1:$port"

echo "starting pdserve up on $url ($prefill prefill + $decode decode)"
"$bin" up --port "$port" --prefill "$prefill" --decode "$decode" \
  --policy cache_aware --gateway-arg=--expose-routing \
  >"$work/up.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 600); do
  if curl -sf "$url/health" >/dev/null 2>&1; then break; fi
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$work/up.log" >&2; fail "pdserve up exited"; }
  sleep 0.5
done
curl -sf "$url/health" >/dev/null || fail "the stack did not come up"

echo "sending traffic for ${traffic_s}s"
# SGLang's shared-prefix set: prompts of a group share a system prompt, so the prefix
# caches and cache_aware's matches show on the page.
"$bin" bench serve --url "$url" --concurrency 2 --dataset shared-prefix \
  --gsp-num-groups 4 --gsp-prompts-per-group 250 --gsp-system-prompt-len 256 \
  --gsp-question-len 32 --gsp-output-len 24 >"$work/bench.log" 2>&1 &
pids+=($!)
sleep "$traffic_s"

# browse URL PNG DOM: a screenshot and the DOM after the page polled a few times.
browse() {
  local flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
    --disable-background-networking --disable-component-update --disable-sync
    --hide-scrollbars --window-size=1400,1000 --virtual-time-budget=4000)
  "$chromium" "${flags[@]}" --user-data-dir="$(mktemp -d -p "$work")" \
    --screenshot="$2" "$1" >"$work/chromium.log" 2>&1 || {
    cat "$work/chromium.log" >&2
    fail "chromium could not take the screenshot of $1"
  }
  "$chromium" "${flags[@]}" --user-data-dir="$(mktemp -d -p "$work")" \
    --dump-dom "$1" >"$3" 2>"$work/chromium.log" || {
    cat "$work/chromium.log" >&2
    fail "chromium could not dump the DOM of $1"
  }
}

mkdir -p "$(dirname "$shot")" "$(dirname "$worker_shot")"
browse "$url/dashboard" "$shot" "$work/gateway.html"
echo "screenshot: $shot"

status=0
check() {
  if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1" >&2; status=1; fi
}
workers=$(curl -sf "$url/instances" | python3 -c 'import json,sys; print("\n".join(w["url"] for w in json.load(sys.stdin)["workers"]))')
[ -n "$workers" ] || fail "/instances lists no workers"
for w in $workers; do
  check "roster row for $w" "grep -q 'data-worker=\"$w\"' '$work/gateway.html'"
done
for chart in requests ttft itl legs; do
  points=$(grep -o "data-chart=\"$chart\" data-points=\"[0-9]*\"" "$work/gateway.html" | grep -o '[0-9]*"$' | tr -d '"' || true)
  check "chart $chart has points (${points:-none})" "[ '${points:-0}' -gt 0 ]"
done
requests=$(grep -o '<tr data-request="[^$]' "$work/gateway.html" | wc -l)
check "request table lists requests ($requests rows)" "[ '$requests' -gt 0 ]"

# The decode worker's page (running sequences and generated tokens move most there).
decode_worker=$(curl -sf "$url/instances" | python3 -c 'import json,sys; ws=json.load(sys.stdin)["workers"]; print(next((w["url"] for w in ws if w["role"]=="decode"), ws[0]["url"]))')
browse "$decode_worker/dashboard" "$worker_shot" "$work/worker.html"
echo "worker screenshot: $worker_shot ($decode_worker)"
for chart in tokens sequences kv; do
  points=$(grep -o "data-chart=\"$chart\" data-points=\"[0-9]*\"" "$work/worker.html" | grep -o '[0-9]*"$' | tr -d '"' || true)
  check "worker chart $chart has points (${points:-none})" "[ '${points:-0}' -gt 0 ]"
done
requests=$(grep -o '<tr data-request="[^$]' "$work/worker.html" | wc -l)
check "worker request table lists requests ($requests rows)" "[ '$requests' -gt 0 ]"

if [ "$status" -ne 0 ]; then
  echo "dashboard check FAILED" >&2
else
  echo "dashboard check passed"
fi
exit "$status"
