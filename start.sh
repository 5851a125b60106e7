#!/usr/bin/env bash
# Start the qwen-jax server in the background and return once /health answers 200 (or fail with the log tail).
# Installs nothing: run `pip install -e .` first. Usage: ./start.sh [python -m server args] | ./start.sh --stop
#   QWEN_JAX_LOG           log file (default ./logs/server.log); the previous start's is kept as its .1
#   QWEN_JAX_PID_FILE      pid file (default ./logs/server.pid)
#   QWEN_JAX_START_TIMEOUT seconds to wait for /health (default 600)
#   QWEN_JAX_STOP_TIMEOUT  seconds to wait after SIGTERM before SIGKILL (default 60)
#   PYTHON                 interpreter (default python3)
set -euo pipefail

cd "$(dirname "$0")"
LOG="${QWEN_JAX_LOG:-$PWD/logs/server.log}"
PID_FILE="${QWEN_JAX_PID_FILE:-$PWD/logs/server.pid}"
START_TIMEOUT="${QWEN_JAX_START_TIMEOUT:-600}"
STOP_TIMEOUT="${QWEN_JAX_STOP_TIMEOUT:-60}"
PYTHON="${PYTHON:-python3}"

running_pid() {
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid="$(cat "$PID_FILE")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

stop_server() {
    local pid
    if ! pid="$(running_pid)"; then
        echo "start.sh: no running server (pid file $PID_FILE)"
        rm -f "$PID_FILE"
        return 0
    fi
    echo "start.sh: stopping server $pid (SIGTERM)"
    kill -TERM "$pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$pid" 2>/dev/null; do
        if (( waited >= STOP_TIMEOUT * 10 )); then
            echo "start.sh: server $pid still running after ${STOP_TIMEOUT}s; sending SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    rm -f "$PID_FILE"
    echo "start.sh: stopped"
}

if [[ "${1:-}" == "--stop" ]]; then
    stop_server
    exit 0
fi

# Port and host from the arguments, for the health check.
PORT=8000
HOST=127.0.0.1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --port) PORT="${args[i + 1]:-8000}" ;;
        --port=*) PORT="${args[i]#--port=}" ;;
        --host) HOST="${args[i + 1]:-127.0.0.1}" ;;
        --host=*) HOST="${args[i]#--host=}" ;;
    esac
done
case "$HOST" in
    0.0.0.0 | "") HOST=127.0.0.1 ;;
    ::) HOST=::1 ;;
esac
[[ "$HOST" == *:* ]] && URL_HOST="[$HOST]" || URL_HOST="$HOST"
HEALTH_URL="http://$URL_HOST:$PORT/health"

if pid="$(running_pid)"; then
    echo "start.sh: a server is already running (pid $pid, $PID_FILE); run '$0 --stop' first" >&2
    exit 1
fi

mkdir -p "$(dirname "$LOG")" "$(dirname "$PID_FILE")"
[[ -f "$LOG" ]] && mv -f "$LOG" "$LOG.1"  # the last run's log, kept for one more start
echo "start.sh: starting 'python -m server $*' (log: $LOG)"
setsid nohup "$PYTHON" -m server "$@" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PID_FILE"

health_status() {
    "$PYTHON" -E -S - "$HEALTH_URL" <<'EOF' 2>/dev/null || echo 000
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")
EOF
}

deadline=$((SECONDS + START_TIMEOUT))
while true; do
    if ! kill -0 "$PID" 2>/dev/null; then
        rc=0
        wait "$PID" 2>/dev/null || rc=$?
        echo "start.sh: the server exited during start-up (exit code $rc). Last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2 || true
        rm -f "$PID_FILE"
        exit 1
    fi
    if [[ "$(health_status)" == "200" ]]; then
        echo "start.sh: server $PID is healthy at $HEALTH_URL"
        exit 0
    fi
    if (( SECONDS >= deadline )); then
        echo "start.sh: $HEALTH_URL not healthy after ${START_TIMEOUT}s. Last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2 || true
        stop_server >&2
        exit 1
    fi
    sleep 1
done
