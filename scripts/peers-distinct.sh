#!/usr/bin/env bash
# The peer harness (../shared/peers/run_peers.sh; same flags) with a request number put at
# the start of every request's last message (scripts/wrk_distinct_chat.lua), so no gateway
# ever sees the same prompt twice: what a cache keyed by prompt text (the gateway's
# --tokenizer pieces, a router's prefix tree) gains on the harness's one repeated body is
# taken away, for every router alike. Runs a copy of the harness with only its wrk script
# swapped.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
peers=$(cd "$here/../shared/peers" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -e "s|^HERE=.*|HERE=$peers|" \
  -e "s|--lua \"\$HERE/wrk_post.lua\"|--lua \"$here/scripts/wrk_distinct_chat.lua\"|" \
  "$peers/run_peers.sh" >"$tmp/run_peers.sh"
grep -q wrk_distinct_chat "$tmp/run_peers.sh" \
  || { echo "the harness no longer names wrk_post.lua as expected: nothing swapped" >&2; exit 1; }
WRK_BASE=$peers/wrk_post.lua bash "$tmp/run_peers.sh" "$@"
