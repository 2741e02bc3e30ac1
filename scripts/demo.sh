#!/usr/bin/env bash
# `make demo`: embedded cluster -> migrate -> load the sample corpus -> start the server ->
# one real query over HTTP, printed with its L0 citations. The server keeps running; stop
# it with `make demo-stop` (which also stops the embedded cluster).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PM="$ROOT/.venv/bin/poimen-memory"
HOST="${POIMEN_DEMO_HOST:-127.0.0.1}"
PORT="${POIMEN_DEMO_PORT:-8765}"
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
if ! curl -fsS "$URL/healthz" >/dev/null 2>&1; then
  echo "== 4. start the server on $URL (log: $STATE/server.log)"
  nohup "$PM" serve --host "$HOST" --port "$PORT" --log-level warning >"$STATE/server.log" 2>&1 &
  echo $! > "$STATE/server.pid"
  for _ in $(seq 1 100); do
    curl -fsS "$URL/healthz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  curl -fsS "$URL/healthz" >/dev/null || { echo "server did not start; see $STATE/server.log"; exit 1; }
else
  echo "== 4. server already running on $URL"
fi
echo "== 5. GET /memory/query?query=why+did+requests+over+10KB+fail&project=poimen"
"$PM" query --url "$URL" "why did requests over 10KB fail" --project poimen
echo
echo "== 6. the server keeps running at $URL (try: curl '$URL/memory/query?query=kong+body+buffer')"
echo "      stop it, and the embedded cluster, with: make demo-stop"
