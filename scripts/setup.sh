#!/usr/bin/env bash
# Installs what poimen-memory needs on Debian 12/13, as root: a PostgreSQL server
# with plpython3u and pgvector >= 0.8, then the project venv. Idempotent: when
# nothing is missing it only runs a few file tests and exits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POIMEN_VENV:-$ROOT/.venv}"
PGVECTOR_VERSION_MIN="0.8.0"
PGVECTOR_SOURCE_SUITE="${POIMEN_PGVECTOR_SUITE:-trixie}"
STATE_DIR="${POIMEN_SETUP_STATE:-/var/cache/poimen-memory/setup}"
PYTHON="${POIMEN_PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

pg_ok() {  # $1 = major version: server, plpython3u and pgvector>=0.8 all present
  local n="$1" ext="/usr/share/postgresql/$1/extension"
  [ -x "/usr/lib/postgresql/$n/bin/postgres" ] || return 1
  [ -f "$ext/plpython3u.control" ] || return 1
  [ -f "$ext/vector.control" ] || return 1
  local v; v="$(sed -n "s/^default_version *= *'\(.*\)'/\1/p" "$ext/vector.control")"
  version_ge "$v" "$PGVECTOR_VERSION_MIN"
}

venv_ok() {
  local stamp="$VENV/.poimen-deps"
  [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && \
    [ "$(cat "$stamp")" = "$(cat "$ROOT/pyproject.toml" "$ROOT/requirements.lock" | sha256sum | cut -d' ' -f1)" ]
}

installed_majors() { ls /usr/lib/postgresql 2>/dev/null | sort -rn; }

# Fast path: a usable major is already installed and the venv matches the lock.
fast_major=""
for n in $(installed_majors); do if pg_ok "$n"; then fast_major="$n"; break; fi; done
if [ -n "$fast_major" ] && venv_ok; then
  mkdir -p "$STATE_DIR" 2>/dev/null && echo "$fast_major" > "$STATE_DIR/pg_major" 2>/dev/null || true
  exit 0
fi

[ "$(id -u)" = 0 ] || die "run as root (apt-get installs are needed); or install PostgreSQL+plpython3u+pgvector yourself"
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$STATE_DIR"

apt_updated=0
apt_update() { if [ "$apt_updated" = 0 ]; then log "apt-get update"; apt-get update -qq; apt_updated=1; fi; }
has_candidate() { local c; c="$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p')"; [ -n "$c" ] && [ "$c" != "(none)" ]; }
installed_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }

choose_major() {
  local cands n default
  default="$(apt-cache depends postgresql 2>/dev/null | sed -n 's/.*Depends: postgresql-\([0-9][0-9]*\)$/\1/p' | head -n1)"
  cands="$(installed_majors) $default"
  for n in $cands; do
    pg_ok "$n" && { echo "$n"; return; }
    { [ -x "/usr/lib/postgresql/$n/bin/postgres" ] || has_candidate "postgresql-$n"; } || continue
    { [ -f "/usr/share/postgresql/$n/extension/plpython3u.control" ] || has_candidate "postgresql-plpython3-$n"; } || continue
    if has_candidate "postgresql-$n-pgvector"; then
      local cv; cv="$(apt-cache policy "postgresql-$n-pgvector" | sed -n 's/^ *Candidate: *//p')"
      version_ge "${cv%%-*}" "$PGVECTOR_VERSION_MIN" && { echo "$n"; return; }
    fi
    has_candidate "postgresql-server-dev-$n" && { echo "$n"; return; }
  done
  return 1
}

if [ -n "$fast_major" ]; then
  N="$fast_major"
else
  apt_update
  N="$(choose_major)" || die "no PostgreSQL major version in this apt suite offers a server, postgresql-plpython3-N and pgvector>=$PGVECTOR_VERSION_MIN (binary or buildable via postgresql-server-dev-N); checked: $(installed_majors) and the suite default"
  log "using PostgreSQL $N"
  pkgs=()
  [ -x "/usr/lib/postgresql/$N/bin/postgres" ] || pkgs+=("postgresql-$N")
  [ -f "/usr/share/postgresql/$N/extension/plpython3u.control" ] || pkgs+=("postgresql-plpython3-$N")
  if [ ${#pkgs[@]} -gt 0 ]; then log "apt-get install ${pkgs[*]}"; apt-get install -y -qq "${pkgs[@]}" >/dev/null; fi
  if ! pg_ok "$N"; then
    if has_candidate "postgresql-$N-pgvector" && version_ge "$(apt-cache policy "postgresql-$N-pgvector" | sed -n 's/^ *Candidate: *//p' | cut -d- -f1)" "$PGVECTOR_VERSION_MIN"; then
      log "apt-get install postgresql-$N-pgvector"
      apt-get install -y -qq "postgresql-$N-pgvector" >/dev/null
    else
      "$ROOT/scripts/build-pgvector.sh" "$N" "$PGVECTOR_SOURCE_SUITE"
    fi
  fi
  pg_ok "$N" || die "PostgreSQL $N is still missing plpython3u or pgvector>=$PGVECTOR_VERSION_MIN after install"
fi
echo "$N" > "$STATE_DIR/pg_major"

if ! venv_ok; then
  log "creating venv at $VENV"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "pip==26.3" >/dev/null
  "$VENV/bin/python" -m pip install -q -c "$ROOT/requirements.lock" -e "$ROOT[dev]"
  cat "$ROOT/pyproject.toml" "$ROOT/requirements.lock" | sha256sum | cut -d' ' -f1 > "$VENV/.poimen-deps"
fi
log "ready: PostgreSQL $N, venv $VENV"
