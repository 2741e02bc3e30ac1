#!/usr/bin/env bash
# `make demo`: embedded cluster -> migrate -> load the sample corpus -> start the server ->
# one real query over HTTP, printed with its L0 citations. The server keeps running; stop
# it with `make demo-stop` (which also stops the embedded cluster).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PM="$ROOT/.venv/bin/poimen-memory"
PY="$ROOT/.venv/bin/python"
HOST="${POIMEN_DEMO_HOST:-127.0.0.1}"
PORT="${POIMEN_DEMO_PORT:-8765}"
# The server answers only the Host names it is told (POIMEN_HTTP_ALLOWED_HOSTS, loopback
# by default): the address it is served on, too.
export POIMEN_HTTP_ALLOWED_HOSTS="${POIMEN_HTTP_ALLOWED_HOSTS:-$HOST:*,127.0.0.1:*,localhost:*,[::1]:*}"
STATE="${POIMEN_DEMO_STATE:-/tmp/poimen-demo}"
mkdir -p "$STATE"

if [ "${1:-}" = "stop" ]; then
  if [ -f "$STATE/server.pid" ] && kill "$(cat "$STATE/server.pid")" 2>/dev/null; then
    echo "demo server stopped"
  fi
  rm -f "$STATE/server.pid"
  "$PM" db stop || true
  exit 0
fi

if [ -z "${POIMEN_DATABASE_URL:-}" ]; then
  echo "== 1. embedded cluster"; "$PM" db start
fi
echo "== 2. migrate"; "$PM" migrate
echo "== 3. load the sample corpus (tests/fixtures/memory_nodes.jsonl, written for this project)"
"$PM" ingest "$ROOT/tests/fixtures/memory_nodes.jsonl" --quiet

URL="http://$HOST:$PORT"
# GET /healthz with the venv's python (no curl needed), bypassing any HTTP proxy.
# Exit 0: healthy (2xx); 2: the server answered with an error (body printed); 1: no answer.
health() {
  "$PY" - "$URL/healthz" <<'PYEOF'
import sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    opener.open(sys.argv[1], timeout=2).read()
except urllib.error.HTTPError as err:
    print(f"GET {sys.argv[1]} -> {err.code}: {err.read().decode(errors='replace')[:600]}")
    sys.exit(2)
except OSError:
    sys.exit(1)
PYEOF
}
server_failed() {
  echo "ERROR: the demo server $1; last lines of $STATE/server.log:" >&2
  tail -n 30 "$STATE/server.log" >&2 || true
  exit 1
}

rc=0; out="$(health)" || rc=$?
if [ "$rc" = 0 ]; then
  echo "== 4. server already running on $URL"
elif [ "$rc" = 2 ]; then
  echo "$out" >&2
  echo "ERROR: something already listens on $URL but its /healthz fails; stop it (make demo-stop) or choose another POIMEN_DEMO_PORT" >&2
  exit 1
else
  echo "== 4. start the server on $URL (log: $STATE/server.log)"
  nohup "$PM" serve --host "$HOST" --port "$PORT" --log-level warning >"$STATE/server.log" 2>&1 &
  pid=$!
  echo "$pid" > "$STATE/server.pid"
  rc=1
  for _ in $(seq 1 150); do   # up to ~30 s
    rc=0; out="$(health)" || rc=$?
    [ "$rc" = 1 ] || break
    kill -0 "$pid" 2>/dev/null || { rm -f "$STATE/server.pid"; server_failed "exited before answering"; }
    sleep 0.2
  done
  case "$rc" in
    0) ;;
    2) echo "$out" >&2; server_failed "started but /healthz reports a problem" ;;
    *) server_failed "did not answer on $URL within 30 s (pid $pid still running)" ;;
  esac
fi
echo "== 5. GET /memory/query?query=why+did+requests+over+10KB+fail&project=poimen"
"$PM" query --url "$URL" "why did requests over 10KB fail" --project poimen
echo
echo "== 6. the server keeps running at $URL (try: $URL/memory/query?query=kong+body+buffer)"
echo "      stop it, and the embedded cluster, with: make demo-stop"
