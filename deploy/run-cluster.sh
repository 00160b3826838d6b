#!/usr/bin/env bash
# `make run-cluster`: redis, scheduler (:9090), gateway (:8080) and one node (:8000)
# on this machine, all sharing $AENV_HOME's API key and snapshot repository.
# Ctrl-C stops them all. More nodes join with AENV_SCHEDULER_URL=http://<this>:9090
# and the same secrets/api-key.
set -euo pipefail
cd "$(dirname "$0")/.."
AENV=.venv/bin/aenv
HOME_DIR=${AENV_HOME:-/var/lib/aenv}
REDIS_PORT=${AENV_REDIS_PORT:-6379}
export AENV_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0 AENV_SCHEDULER_URL=http://127.0.0.1:9090
mkdir -p "$HOME_DIR/run"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --logfile "$HOME_DIR/run/redis.log" & pids+=($!)
until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.1; done
$AENV scheduler --port 9090 & pids+=($!)
$AENV gateway --port 8080 & pids+=($!)
$AENV server --port 8000 & pids+=($!)
wait -n
