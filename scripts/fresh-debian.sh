#!/usr/bin/env bash
# The README's two commands on fresh, minimal Debian machines: for each release, a
# debootstrap `minbase` root plus only the README's prerequisites (make, git), a clone of
# the committed HEAD made inside it with its own git, then `make demo`, `make demo-stop`
# and `make test` in a chroot. Prints timings, versions and the pytest summary line per
# release. For contributors (docs/fresh-debian.md); not part of CI. Run as root.
#
#   scripts/fresh-debian.sh [--ref REV] [--rebuild] [--clean] [RELEASE...]
#       RELEASE   bookworm and/or trixie (default: both, one after the other)
#       --ref     the commit to test (default HEAD; uncommitted changes are never tested)
#       --rebuild debootstrap the cached base root again (otherwise reused: it is never
#                 changed, each run works in a fresh copy of it)
#       --clean   delete each run's root afterwards (default: kept for inspection)
#       --prepare only debootstrap the base roots that are missing, run nothing
# Environment:
#   POIMEN_FRESH_ROOTS     where roots and logs live (default /var/tmp/poimen-roots)
#   POIMEN_FRESH_MIRROR    Debian mirror (default http://deb.debian.org/debian)
#   POIMEN_FRESH_SECURITY  security mirror (default http://deb.debian.org/debian-security)
#   POIMEN_FRESH_INCLUDE   packages added to minbase (default make,git: the README's list)
#   POIMEN_FRESH_PG_PORT, POIMEN_FRESH_DEMO_PORT
#                          TCP ports for the demo inside the root (default 54339, 8775):
#                          a chroot shares the host's network, so keep clear of the host's
#   POIMEN_FRESH_CA        a CA bundle the root's pip should trust; default: the host's
#                          $PIP_CERT or $SSL_CERT_FILE when set (a host behind a TLS-
#                          intercepting proxy). A plain Debian machine needs none.
set -euo pipefail
# The whole script is one compound command: bash parses all of it before running any, so
# editing this file while a run is under way cannot change what that run executes.
{

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOTS="${POIMEN_FRESH_ROOTS:-/var/tmp/poimen-roots}"
MIRROR="${POIMEN_FRESH_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${POIMEN_FRESH_SECURITY:-http://deb.debian.org/debian-security}"
INCLUDE="${POIMEN_FRESH_INCLUDE:-make,git}"
PG_PORT="${POIMEN_FRESH_PG_PORT:-54339}"
DEMO_PORT="${POIMEN_FRESH_DEMO_PORT:-8775}"
CA="${POIMEN_FRESH_CA-${PIP_CERT:-${SSL_CERT_FILE:-}}}"

REF=HEAD; REBUILD=0; CLEAN=0; PREPARE=0; RELEASES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ref) REF="$2"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    --clean) CLEAN=1; shift ;;
    --prepare) PREPARE=1; shift ;;
    bookworm | trixie) RELEASES+=("$1"); shift ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(bookworm trixie)
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, mount, chroot)" >&2; exit 1; }

say() { printf '[fresh %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

if ! command -v debootstrap >/dev/null 2>&1; then
  say "apt-get install debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

# One run at a time per roots folder: a second run would delete the first one's root
# under it (and two test suites at once overload a small machine).
mkdir -p "$ROOTS"
exec 9>"$ROOTS/.lock"
if ! flock -n 9; then
  say "another fresh-debian.sh run holds $ROOTS/.lock: waiting for it to finish"
  flock 9
fi

COMMIT="$(git -C "$REPO" rev-parse --verify "$REF^{commit}")"
SUBJECT="$(git -C "$REPO" log -1 --format=%s "$COMMIT")"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
LOGS="$ROOTS/logs/$STAMP"
mkdir -p "$LOGS"
SUMMARY="$LOGS/summary.txt"
say "testing commit ${COMMIT:0:12} ($SUBJECT); logs in $LOGS"

MOUNTED=()   # mount points inside the current run root, most recent last
CURRENT=""   # the current run root
cleanup() {
  local r="$CURRENT" p i
  [ -n "$r" ] || return 0
  # End what we started inside the root (the demo server, PostgreSQL clusters): every
  # process whose root directory is this run root, by its pid.
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$r" ] && kill -TERM "${p#/proc/}" 2>/dev/null || true
  done
  sleep 1
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$r" ] && kill -KILL "${p#/proc/}" 2>/dev/null || true
  done
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null || true
  done
  MOUNTED=()
  if [ "$CLEAN" = 1 ]; then rm -rf --one-file-system "$r"; fi
  CURRENT=""
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mnt() {  # mnt TARGET ARGS...: mount and remember for the exit trap
  local target="$1"; shift
  mkdir -p "$target"
  mount "$@" "$target"
  MOUNTED+=("$target")
}

base_root() {  # debootstrap once per release; the base is never modified afterwards
  local rel="$1" base="$ROOTS/base-$1"
  if [ "$REBUILD" = 0 ] && [ -f "$base/.poimen-base-ok" ]; then
    say "$rel: reusing base root $base (built $(cat "$base/.poimen-base-ok"))"
    return
  fi
  rm -rf --one-file-system "$base"
  say "$rel: debootstrap --variant=minbase --include=$INCLUDE ($MIRROR)"
  local t0; t0="$(now)"
  debootstrap --variant=minbase --include="$INCLUDE" "$rel" "$base" "$MIRROR" \
    >"$LOGS/$rel-debootstrap.log" 2>&1 || { tail -n 20 "$LOGS/$rel-debootstrap.log"; return 1; }
  # What a Debian installation has: the release, its point updates and security updates.
  cat >"$base/etc/apt/sources.list" <<EOF
deb $MIRROR $rel main
deb $MIRROR $rel-updates main
deb $SECURITY $rel-security main
EOF
  rm -rf "$base/var/lib/apt/lists/"* "$base/var/cache/apt/archives/"*.deb
  date -u +%Y-%m-%dT%H:%MZ >"$base/.poimen-base-ok"
  say "$rel: base root ready in $(secs "$t0" "$(now)") s"
}

# Runs a command as root inside the run root, with a clean environment (the host's pip
# settings, caches and tool paths stay outside), output to stdout and to a log file.
in_root() {
  local r="$1" log="$2"; shift 2
  local envs=(HOME=/root LANG=C.UTF-8 TERM=dumb
              PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
              POIMEN_PG_PORT="$PG_PORT" POIMEN_DEMO_PORT="$DEMO_PORT")
  if [ -n "$CA" ]; then
    envs+=(PIP_CERT=/etc/poimen-fresh/ca.crt SSL_CERT_FILE=/etc/poimen-fresh/ca.crt
           REQUESTS_CA_BUNDLE=/etc/poimen-fresh/ca.crt)
  fi
  chroot "$r" /usr/bin/env -i "${envs[@]}" /bin/bash -c "$*" </dev/null 9>&- 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

run_release() {
  local rel="$1" r="$ROOTS/run-$1"
  base_root "$rel"
  rm -rf --one-file-system "$r"
  cp -a "$ROOTS/base-$rel" "$r"
  CURRENT="$r"
  mnt "$r/proc" -t proc proc
  mnt "$r/sys" -t sysfs -o ro sysfs
  mnt "$r/dev" --bind /dev
  mnt "$r/dev/pts" --bind /dev/pts
  mnt "$r/dev/shm" -t tmpfs -o mode=1777,nosuid,nodev shm
  cp -L /etc/resolv.conf "$r/etc/resolv.conf"
  [ -s "$r/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$r/etc/hosts"
  if [ -n "$CA" ]; then
    mkdir -p "$r/etc/poimen-fresh"; cp -L "$CA" "$r/etc/poimen-fresh/ca.crt"
    say "$rel: pip in the root trusts $CA (this host's registry access goes through it)"
  fi
  # The repository travels as a bundle; the root's own git clones it (git is a prerequisite).
  git -C "$REPO" bundle create -q "$r/root/poimen.bundle" --all
  in_root "$r" "$LOGS/$rel-clone.log" \
    "git clone -q /root/poimen.bundle /root/poimen-memory && cd /root/poimen-memory && git checkout -q --detach $COMMIT && git log -1 --oneline" >/dev/null

  local t0 demo_s demo_rc=0 test_s test_rc=0
  say "$rel: make demo"
  t0="$(now)"
  in_root "$r" "$LOGS/$rel-demo.log" "cd /root/poimen-memory && make demo" || demo_rc=$?
  demo_s="$(secs "$t0" "$(now)")"
  local compilers; compilers="$(in_root "$r" /dev/null 'for c in cc gcc g++ c++; do command -v $c; done | paste -sd " "')"
  in_root "$r" "$LOGS/$rel-demo-stop.log" "cd /root/poimen-memory && make demo-stop" >/dev/null || true

  say "$rel: make test"
  t0="$(now)"
  in_root "$r" "$LOGS/$rel-test.log" "cd /root/poimen-memory && make test" || test_rc=$?
  test_s="$(secs "$t0" "$(now)")"

  local versions pyline
  versions="$(in_root "$r" /dev/null '
    . /etc/os-release; printf "Debian %s (%s)\n" "$(cat /etc/debian_version)" "$VERSION_CODENAME"
    n=$(cat /var/cache/poimen-memory/setup/pg_major 2>/dev/null || ls /usr/lib/postgresql | sort -n | tail -1)
    printf "%s\n" "$(/usr/lib/postgresql/$n/bin/postgres --version 2>/dev/null || echo "PostgreSQL: none")"
    printf "pgvector %s\n" "$(sed -n "s/^default_version *= *.\(.*\)./\1/p" /usr/share/postgresql/$n/extension/vector.control 2>/dev/null || echo none)"
    printf "PL/Python and venv on %s\n" "$(python3 --version 2>&1)"')"
  pyline="$(grep -E '[0-9]+ (passed|failed|errors?)' "$LOGS/$rel-test.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')"
  {
    echo "== $rel, commit ${COMMIT:0:12} ($SUBJECT)"
    echo "$versions" | sed 's/^/   /'
    echo "   make demo: ${demo_s} s, $([ "$demo_rc" = 0 ] && echo ok || echo "FAILED (exit $demo_rc)"); compilers afterwards: ${compilers:-none}"
    echo "   make test: ${test_s} s, $([ "$test_rc" = 0 ] && echo ok || echo "FAILED (exit $test_rc)"); pytest: ${pyline:-no summary line}"
    echo "   logs: $LOGS/$rel-{demo,test}.log; root: $r"
  } | tee -a "$SUMMARY"
  cleanup
  [ "$demo_rc" = 0 ] && [ "$test_rc" = 0 ]
}

if [ "$PREPARE" = 1 ]; then
  for rel in "${RELEASES[@]}"; do base_root "$rel"; done
  exit 0
fi
status=0
for rel in "${RELEASES[@]}"; do
  run_release "$rel" || status=1
done
echo
cat "$SUMMARY"
exit "$status"
}
