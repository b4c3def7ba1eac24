#!/usr/bin/env bash
# A small pdserve cluster on one machine: every host is a network namespace with its own
# address on a private bridge (itself in a namespace), joined by veth pairs, so requests
# and KV transfers cross real links between addresses:
#
#   gw 10.77.0.2 (gateway)   p1 10.77.0.11, p2 10.77.0.12 (prefill)   d 10.77.0.20 (decode)
#   ag 10.77.0.30 (aggregated reference worker)   p3 10.77.0.13 (a host that joins later)
#
# It checks that P/D output across hosts equals the aggregated worker's (greedy), that a
# killed prefill worker is evicted and its traffic goes to the other one, and that a new
# worker on a new host is discovered through the gateway's --discover-file and served.
# Every address lives inside the namespaces this script creates; it removes them on exit.
#
#   PDSERVE=target/debug/pdserve MODEL=~/.cache/pdserve/....gguf scripts/cluster-test.sh
#
# Exit status: 0 passed, 1 failed, 77 skipped (not root, no `ip`, no network namespaces),
# with the reason on stderr.
set -euo pipefail
shopt -s nullglob

PDSERVE=${PDSERVE:?set PDSERVE to the pdserve binary}
MODEL=${MODEL:?set MODEL to a GGUF file}
SUBNET=10.77.0
ID="pdc$$"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-cluster.XXXXXX")
PIDS=()
HOSTS=(sw)

skip() { echo "SKIP: $*" >&2; exit 77; }
fail() { echo "FAIL: $*" >&2; for log in "$WORK"/*.log; do echo "--- $log" >&2; tail -n 20 "$log" >&2; done; exit 1; }
ns() { echo "$ID-$1"; }
on() { local host=$1; shift; ip netns exec "$(ns "$host")" "$@"; }

[ "$(id -u)" = 0 ] || skip "needs root for network namespaces (uid $(id -u))"
command -v ip >/dev/null || skip "needs iproute2's ip"
command -v curl >/dev/null || skip "needs curl"
command -v python3 >/dev/null || skip "needs python3"
ip netns add "$ID-probe" 2>/dev/null || skip "cannot create network namespaces here"
ip netns del "$ID-probe"

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    # Anything else still running in a host goes with it.
    for host in "${HOSTS[@]}"; do
        ip netns pids "$(ns "$host")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    for host in "${HOSTS[@]}"; do ip netns del "$(ns "$host")" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# The switch: a bridge in its own namespace.
ip netns add "$(ns sw)"
on sw ip link add br0 type bridge
on sw ip link set br0 up

# host NAME LAST_OCTET: a namespace with eth0 at $SUBNET.LAST_OCTET on the bridge.
host() {
    local name=$1 octet=$2
    ip netns add "$(ns "$name")"
    HOSTS+=("$name")
    ip link add "$ID$name" netns "$(ns "$name")" type veth peer name "$ID${name}b" netns "$(ns sw)"
    on "$name" ip link set "$ID$name" name eth0
    on "$name" ip addr add "$SUBNET.$octet/24" dev eth0
    on "$name" ip link set eth0 up
    on "$name" ip link set lo up
    on sw ip link set "$ID${name}b" master br0 up
}

# worker HOST OCTET ROLE: a pdserve worker bound to its host's address.
worker() {
    local name=$1 octet=$2 role=$3
    # Not through `on`: $! must be the process itself (ip netns exec execs it).
    ip netns exec "$(ns "$name")" "$PDSERVE" --log warn worker --role "$role" --host "$SUBNET.$octet" --port 8100 \
        --kv-port 8200 --kv-peers "$SUBNET.0/24" --threads 1 --num-kv-blocks 128 \
        --model "$MODEL" >"$WORK/$name.log" 2>&1 &
    PIDS+=($!)
    eval "PID_$name=$!"
}

# From the gateway host, like every client of this cluster.
get() { on gw curl -sf --max-time 30 "$@"; }

wait_healthy() {
    local url=$1 limit=${2:-180}
    for _ in $(seq $((limit * 10))); do
        get -o /dev/null "$url" && return 0
        sleep 0.1
    done
    fail "$url not healthy within ${limit}s"
}

listing() {
    printf 'workers:\n' >"$WORK/listing.tmp"
    for entry in "$@"; do printf '  - {url: "http://%s:8100", role: %s}\n' "${entry%=*}" "${entry#*=}" >>"$WORK/listing.tmp"; done
    mv "$WORK/listing.tmp" "$WORK/listing.yaml"
}

# completion BASE PROMPT: the greedy text, and the prefill host the gateway chose (if it says).
completion() {
    local base=$1 prompt=$2
    get -D "$WORK/headers" -H 'Content-Type: application/json' "$base/v1/completions" \
        -d "{\"prompt\": \"$prompt\", \"max_tokens\": 16, \"temperature\": 0}" >"$WORK/body" \
        || fail "completion via $base failed"
    TEXT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$WORK/body")
    PREFILLED_BY=$(tr -d '\r' <"$WORK/headers" | sed -n 's/^x-pdserve-prefill: //Ip')
}

roster_health() {
    get "http://$SUBNET.2:8000/instances" | python3 -c '
import json, sys
url = sys.argv[1]
for w in json.load(sys.stdin)["workers"]:
    if w["url"] == url:
        print(w["health"])' "$1"
}

tx_bytes() { on "$1" cat /sys/class/net/eth0/statistics/tx_bytes; }

for spec in gw:2 p1:11 p2:12 d:20 ag:30 p3:13; do host "${spec%:*}" "${spec#*:}"; done

worker p1 11 prefill
worker p2 12 prefill
worker d 20 decode
worker ag 30 prefill_decode
listing "$SUBNET.11=prefill" "$SUBNET.12=prefill" "$SUBNET.20=decode"
ip netns exec "$(ns gw)" "$PDSERVE" --log warn gateway --host "$SUBNET.2" --port 8000 \
    --discover-file "$WORK/listing.yaml" --discover-interval 0.5 \
    --probe-interval 1 --probe-timeout 1 --fail-threshold 1 \
    --prefill-policy round_robin --expose-routing >"$WORK/gw.log" 2>&1 &
PIDS+=($!)
for octet in 11 12 20 30; do wait_healthy "http://$SUBNET.$octet:8100/health"; done
wait_healthy "http://$SUBNET.2:8000/health" 30
echo "cluster up: gateway $SUBNET.2, prefill $SUBNET.11 $SUBNET.12, decode $SUBNET.20, reference $SUBNET.30"

GATEWAY="http://$SUBNET.2:8000"
PROMPTS=("The capital of France is" "Three tips for staying healthy:" "Once upon a time, in a small village,")
declare -A REFERENCE
for prompt in "${PROMPTS[@]}"; do
    completion "http://$SUBNET.30:8100" "$prompt"
    REFERENCE[$prompt]=$TEXT
done

# P/D across hosts equals aggregated, on both prefill hosts.
p1_tx=$(tx_bytes p1)
declare -A USED
for prompt in "${PROMPTS[@]}" "${PROMPTS[@]}"; do
    completion "$GATEWAY" "$prompt"
    [ "$TEXT" = "${REFERENCE[$prompt]}" ] || fail "P/D gave '$TEXT' for '$prompt', aggregated '${REFERENCE[$prompt]}'"
    USED[$PREFILLED_BY]=1
done
[ -n "${USED[http://$SUBNET.11:8100]:-}" ] && [ -n "${USED[http://$SUBNET.12:8100]:-}" ] \
    || fail "both prefill hosts should have served: ${!USED[*]}"
sent=$(( $(tx_bytes p1) - p1_tx ))
[ "$sent" -gt 10000 ] || fail "prefill host p1 sent only $sent bytes: KV did not cross its link"
echo "ok: P/D across hosts equals aggregated for ${#PROMPTS[@]} prompts, both prefill hosts used (p1 sent $sent bytes)"

# A killed prefill worker is evicted; requests keep succeeding on the other host.
kill -9 "$PID_p1"
killed_at=$(date +%s.%N)
for _ in $(seq 100); do
    [ "$(roster_health "http://$SUBNET.11:8100")" = evicted ] && break
    sleep 0.1
done
[ "$(roster_health "http://$SUBNET.11:8100")" = evicted ] \
    || fail "the killed prefill worker was not evicted: $(get "$GATEWAY/instances")"
evicted_after=$(python3 -c "import time; print(f'{time.time() - $killed_at:.2f}')")
for prompt in "${PROMPTS[@]}"; do
    completion "$GATEWAY" "$prompt"
    [ "$TEXT" = "${REFERENCE[$prompt]}" ] || fail "after the kill: '$TEXT' for '$prompt'"
    [ "$PREFILLED_BY" = "http://$SUBNET.12:8100" ] || fail "after the kill, prefilled by $PREFILLED_BY"
done
echo "ok: killed prefill worker evicted after ${evicted_after}s, its traffic served by $SUBNET.12"

# A worker on a new host joins through the listing and is served.
worker p3 13 prefill
wait_healthy "http://$SUBNET.13:8100/health"
listing "$SUBNET.12=prefill" "$SUBNET.13=prefill" "$SUBNET.20=decode"
listed_at=$(date +%s.%N)
for _ in $(seq 100); do
    [ "$(roster_health "http://$SUBNET.13:8100")" = live ] && break
    sleep 0.1
done
[ "$(roster_health "http://$SUBNET.13:8100")" = live ] || fail "the new host's worker was not discovered"
discovered_after=$(python3 -c "import time; print(f'{time.time() - $listed_at:.2f}')")
[ -z "$(roster_health "http://$SUBNET.11:8100")" ] || fail "the unlisted dead worker is still in the roster"
served=
for prompt in "${PROMPTS[@]}" "${PROMPTS[@]}"; do
    completion "$GATEWAY" "$prompt"
    [ "$TEXT" = "${REFERENCE[$prompt]}" ] || fail "with the new host: '$TEXT' for '$prompt'"
    [ "$PREFILLED_BY" = "http://$SUBNET.13:8100" ] && served=1
done
[ -n "$served" ] || fail "the new host's worker never prefilled"
echo "ok: new host $SUBNET.13 discovered ${discovered_after}s after the listing changed, and served"
echo "cluster test passed"
