#!/usr/bin/env bash
# Debian's Chromium for the query explorer's browser test (tests/test_ui_browser.py).
# Idempotent: a fast no-op when /usr/bin/chromium exists. Nothing here downloads a browser
# build of its own (`playwright install` is never run): Playwright's Python package drives
# this Chromium through executable_path.
set -euo pipefail

if [[ -x /usr/bin/chromium ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "setup-browser: /usr/bin/chromium is missing; run as root: apt-get install chromium" >&2
  exit 1
fi
echo "setup-browser: installing Debian's chromium"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
  apt-get update -qq
  apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
/usr/bin/chromium --version
