#!/usr/bin/env bash
# Builds pgvector from Debian's own source package for PostgreSQL major $1, using a
# private, throw-away APT configuration so /etc/apt is never changed while the
# archive signatures are still checked.
set -euo pipefail
N="$1"; SUITE="${2:-trixie}"
log() { printf '[pgvector] %s\n' "$*" >&2; }
export DEBIAN_FRONTEND=noninteractive

log "installing postgresql-server-dev-$N build-essential"
out="$(mktemp)"
apt-get install -y -qq "postgresql-server-dev-$N" build-essential >"$out" 2>&1 || { tail -n 30 "$out" >&2; exit 1; }
rm -f "$out"

# Reuse the mirror this machine is already configured with.
mirror="$( (grep -rhoE '^(URIs:|deb) +[a-z]+://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null || true) \
          | sed -E 's/^(URIs:|deb) +//; s/ *$//' | head -n1)"
[ -n "$mirror" ] || { log "cannot find a Debian mirror in /etc/apt"; exit 1; }

work="$(mktemp -d /tmp/poimen-pgvector.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
# apt drops privileges to _apt for downloads; let it write into the private dirs.
id _apt >/dev/null 2>&1 && chown -R _apt "$work"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $SUITE main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache")
log "fetching pgvector source from $SUITE"
apt-get "${apt_opts[@]}" update -qq
(cd "$work/src" && apt-get "${apt_opts[@]}" source -qq --download-only pgvector >/dev/null)
dsc="$(ls "$work"/src/pgvector_*.dsc | head -n1)"
# apt already verified the .dsc against the signed suite Release file; the inline
# uploader signature would need debian-keyring, which the image does not carry.
(cd "$work/src" && dpkg-source --no-check -x "$dsc" build >/dev/null)
log "building $(basename "$dsc" .dsc) against PostgreSQL $N"
make -s -C "$work/src/build" PG_CONFIG="/usr/lib/postgresql/$N/bin/pg_config" >/dev/null
make -s -C "$work/src/build" PG_CONFIG="/usr/lib/postgresql/$N/bin/pg_config" install >/dev/null
log "installed"
