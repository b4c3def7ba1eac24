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
