#!/usr/bin/env bash
# harness-hash.sh OUT: runs the engine's fake-backend tests with every harness hashing
# its scheduler's decisions (plans, batches, results, events: internal/engine/
# harnesshash_test.go) and writes the sorted "test hash decisions" lines to OUT. Run it
# before and after a refactor of the scheduler and diff the two files: equal files mean
# every harness saw the same decisions. A test that fails is reported and fails the run.
set -euo pipefail
out=${1:?usage: scripts/harness-hash.sh OUT}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
cd "$(dirname "$0")/.."
eval "$(make -s env)"
POLYKV_HARNESS_HASH=$raw go test ./internal/engine/ -count=1 -p 1 >/dev/null
LC_ALL=C sort "$raw" >"$out"
echo "$(wc -l <"$out") harness traces in $out"
