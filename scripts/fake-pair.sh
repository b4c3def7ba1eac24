# Sourced by the gateway-overhead scripts: the peer harness's fake vLLM prefill (port 18801,
# bootstrap 18899) and decode (18802) workers on 127.0.0.1, stopped with every pid the
# script adds to `pids` when it exits. Sets `here` (the repository), `peers` (the harness)
# and `bin` (pdserve, $PDSERVE or the release build).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=$here/../shared/peers
bin=${PDSERVE:-$here/target/release/pdserve}
fake=${PEERS_SCRATCH:-${TMPDIR:-/tmp}/peers}/target/release/fakeworker
[ -x "$fake" ] || { echo "no fake worker at $fake: run ../shared/peers/run_peers.sh once" >&2; exit 1; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
"$fake" --host 127.0.0.1 --port 18801 --mode prefill --bootstrap-port 18899 >/dev/null 2>&1 & pids+=($!)
"$fake" --host 127.0.0.1 --port 18802 --mode decode >/dev/null 2>&1 & pids+=($!)
