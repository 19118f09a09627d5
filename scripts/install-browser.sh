#!/usr/bin/env bash
# Install the headless browser the dashboard test drives (tests/ui via selenium):
# Debian's chromium and chromium-driver. Idempotent: does nothing when both binaries are
# already there, so `make test` pays for it once per machine. CI runs as root; elsewhere
# sudo is used when present. The browser comes from Debian's own packages because the
# build machines reach only the package registries (no browser downloads at run time).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-browser: need root (or sudo) to apt-get install chromium chromium-driver" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt run (a parallel job) instead of failing on its lock.
lock=(-o DPkg::Lock::Timeout=600)
$SUDO apt-get "${lock[@]}" update -qq
# fonts-dejavu-core: without any font the page's text renders as boxes in screenshots.
$SUDO apt-get "${lock[@]}" install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
/usr/bin/chromium --version 2>/dev/null
/usr/bin/chromedriver --version
