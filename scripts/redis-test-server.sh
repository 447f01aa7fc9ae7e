#!/usr/bin/env bash
# A throwaway redis-server on loopback for the tier tests and benchmarks.
#
#   scripts/redis-test-server.sh start DIR [PORT]   write DIR/redis.conf, start the
#                                                   server, print its URL
#   scripts/redis-test-server.sh stop DIR           stop it (no save)
#
# The server keeps nothing on disk (no RDB, no AOF) and runs as a daemon with
# its pid and log in DIR. Tests that stop and restart it find the executable
# and this config file through INFO server, so they restart the same server.
set -euo pipefail
cmd=${1:?usage: redis-test-server.sh start|stop DIR [PORT]}
dir=$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)
case "$cmd" in
  start)
    port=${3:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    cat > "$dir/redis.conf" <<CONF
bind 127.0.0.1
port $port
daemonize yes
pidfile $dir/redis.pid
logfile $dir/redis.log
dir $dir
save ""
appendonly no
CONF
    redis-server "$dir/redis.conf"
    for _ in $(seq 100); do
      redis-cli -p "$port" ping >/dev/null 2>&1 && { echo "redis://127.0.0.1:$port/0"; exit 0; }
      sleep 0.05
    done
    echo "redis-test-server: no answer on port $port; log:" >&2
    cat "$dir/redis.log" >&2 || true
    exit 1
    ;;
  stop)
    if [ -f "$dir/redis.pid" ]; then
      pid=$(cat "$dir/redis.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.05; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    ;;
  *) echo "usage: redis-test-server.sh start|stop DIR [PORT]" >&2; exit 2 ;;
esac
