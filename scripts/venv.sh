#!/usr/bin/env bash
# Create (or refresh) the Python virtual environment the tests and demo use, from the
# pinned lock file. It lives outside the repo so clean clones reuse it; it is rebuilt
# only when the lock file changes.
set -euo pipefail
VENV="${1:-${POLYKV_CACHE:-$HOME/.cache/polykv}/venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LOCK="$ROOT/requirements-test.lock"
# Only the pinned dependencies live in the venv; the checkout's own package is put on
# PYTHONPATH by the Makefile, so any clone (CI's included) tests its own code.
want=$(sha256sum < "$LOCK" | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.polykv-lock" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$LOCK"
echo "$want" > "$VENV/.polykv-lock"
echo "venv ready: $VENV"
