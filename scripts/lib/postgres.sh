# Shared by the bench scripts (sourced): a throwaway PostgreSQL on 127.0.0.1 in a temp
# folder (as the `postgres` user when run as root), as crates/history's LocalPostgres makes
# one for the tests. `pg_start PORT` sets PG_URL; `pg_stop` removes it all.

PG_DIR=""
pg_as() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pg_start() {
  local port=$1 bin
  bin=$(pg_config --bindir)
  PG_DIR=$(mktemp -d /tmp/pdserve-bench-pg.XXXXXX)
  [ "$(id -u)" = 0 ] && chown postgres "$PG_DIR"
  pg_as "$bin/initdb" -D "$PG_DIR/data" -A trust -U postgres >/dev/null
  pg_as "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w -t 30 \
    -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$PG_DIR" start >/dev/null
  pg_as "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres pdserve
  PG_URL="postgres://postgres@127.0.0.1:$port/pdserve"
}

pg_stop() {
  [ -n "$PG_DIR" ] || return 0
  pg_as "$(pg_config --bindir)/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$PG_DIR"
  PG_DIR=""
}
