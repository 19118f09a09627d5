#!/usr/bin/env bash
# Create (or refresh) the Python virtual environment the tests and demo use, from the
# pinned lock file. It lives outside the repo so clean clones reuse it; it is rebuilt
# only when the lock file changes.
set -euo pipefail
VENV="${1:-${POLYKV_CACHE:-$HOME/.cache/polykv}/venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LOCK="$ROOT/requirements-test.lock"
want=$( (cat "$LOCK"; find "$ROOT/python" -name pyproject.toml -exec cat {} + 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.polykv-lock" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$LOCK"
if [ -f "$ROOT/python/pyproject.toml" ]; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT/python"
fi
echo "$want" > "$VENV/.polykv-lock"
echo "venv ready: $VENV"
