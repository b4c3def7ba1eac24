# Shared by the bench scripts (sourced): waiting for a stack `pdserve up` started.

# Waits (at most 5 min) until the stack on 127.0.0.1:$1 answers /health.
wait_up() {
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "the stack on port $1 did not come up" >&2
  return 1
}

# Waits (at most 5 min) until `pdserve up`'s log $1 holds its banner (the workers' lines
# come before "Ctrl-C stops everything").
wait_banner() {
  for _ in $(seq 1 600); do
    if grep -q "Ctrl-C stops everything" "$1" 2>/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "no banner in $1" >&2
  return 1
}
