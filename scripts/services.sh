#!/usr/bin/env bash
# Make sure the PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) the tests use are running: start them
# when they are installed but stopped, or say in one line what is missing (exit status 1). Sourced or run by
# scripts/test.sh (and so by .ci/run).
set -euo pipefail

_pg_up() { pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; }
_redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }

ensure_services() {
  local missing=()
  command -v pg_isready >/dev/null 2>&1 && command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ] \
    || missing+=("PostgreSQL (apt-get install postgresql)")
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
    || missing+=("Redis (apt-get install redis-server)")
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "the tests need ${missing[*]}, which is not installed here" >&2
    return 1
  fi
  if ! _pg_up; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  fi
  if ! _redis_up; then
    echo "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  fi
  for _ in $(seq 1 50); do
    _pg_up && _redis_up && return 0
    sleep 0.2
  done
  _pg_up || { echo "PostgreSQL is installed but did not start on 127.0.0.1:5432" >&2; return 1; }
  echo "Redis is installed but did not start on 127.0.0.1:6379" >&2
  return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_services
fi
