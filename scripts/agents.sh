#!/usr/bin/env bash
# Install (or refresh) the agent CLIs the tests run headless against a live server:
# Claude Code and Codex at the versions pinned in scripts/agents/package-lock.json (npm
# ci), and opencode at OPENCODE_VERSION below (npm cannot lock opencode-ai's platform
# packages: `npm ci` then refuses the lock as out of sync, so it is installed by exact
# version into a folder of its own), into a directory outside the repo, so clean clones
# reuse it. It is reinstalled only when these pins change. Prints nothing on a no-op.
# Usage: scripts/agents.sh [DIR]   (default $POLYKV_CACHE/agents)
set -euo pipefail
OPENCODE_VERSION=1.18.33
DIR="${1:-${POLYKV_CACHE:-$HOME/.cache/polykv}/agents}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
want=$( (cat "$ROOT/scripts/agents/package.json" "$ROOT/scripts/agents/package-lock.json"; echo "opencode-ai@$OPENCODE_VERSION") | sha256sum | cut -d' ' -f1)
if [ -x "$DIR/node_modules/.bin/claude" ] && [ -x "$DIR/node_modules/.bin/codex" ] && [ -x "$DIR/node_modules/.bin/opencode" ] && [ "$(cat "$DIR/.polykv-lock" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "agents.sh: npm (Node.js 18 or newer) is needed to install the agent CLIs" >&2; exit 1; }
rm -rf "$DIR"
mkdir -p "$DIR"
cp "$ROOT/scripts/agents/package.json" "$ROOT/scripts/agents/package-lock.json" "$DIR/"
# Install scripts stay off (npm's own default now asks for them to be allowed one by
# one); Claude Code's and opencode's are run by name: each links the platform binary
# that came as an optional dependency in place of its launcher.
(cd "$DIR" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error && node node_modules/@anthropic-ai/claude-code/install.cjs)
mkdir -p "$DIR/opencode"
(cd "$DIR/opencode" && echo '{"private": true}' > package.json && npm install --ignore-scripts --no-audit --no-fund --loglevel=error "opencode-ai@$OPENCODE_VERSION" && node node_modules/opencode-ai/postinstall.mjs)
ln -sf "$DIR/opencode/node_modules/.bin/opencode" "$DIR/node_modules/.bin/opencode"
"$DIR/node_modules/.bin/claude" --version >/dev/null
"$DIR/node_modules/.bin/codex" --version >/dev/null
"$DIR/node_modules/.bin/opencode" --version >/dev/null
echo "$want" > "$DIR/.polykv-lock"
echo "agent CLIs ready: $DIR ($("$DIR/node_modules/.bin/claude" --version); $("$DIR/node_modules/.bin/codex" --version); opencode $("$DIR/node_modules/.bin/opencode" --version))"
