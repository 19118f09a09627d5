#!/usr/bin/env bash
# Run every Go fuzz target in the repository briefly (FUZZTIME each, default 10s), so
# make test exercises them beyond their seed corpus. go test -fuzz takes one package and
# one target at a time, hence the loop. Targets are found by name: no list to maintain.
set -euo pipefail
cd "$(dirname "$0")/.."
t="${FUZZTIME:-10s}"
grep -rlE '^func Fuzz[A-Za-z0-9_]+\(f \*testing\.F\)' --include='*_test.go' internal cmd 2>/dev/null | sort | while read -r file; do
  pkg="./$(dirname "$file")"
  for fn in $(grep -oE '^func Fuzz[A-Za-z0-9_]+' "$file" | cut -d' ' -f2); do
    echo "fuzz $pkg $fn ($t)"
    # -fuzzminimizetime: go minimizes every new interesting input for up to 60 s by
    # default, and while both workers minimize no input is fuzzed (seen as 40-60 s
    # stretches of "0/sec": a 10 s run could spend all of it minimizing, and a 120 s
    # run of FuzzSchedulerInvariants managed 14k execs). 2 s keeps the corpus entries
    # small enough and the run fuzzing (60k execs in 60 s); a failing input is still
    # written, less minimized.
    # go's fuzz coordinator can end a run with "context deadline exceeded" when a worker
    # is still minimizing a new input as the time runs out (no failing input is written):
    # a toolchain hiccup, not a finding, so that case runs once more. A real failure
    # writes its input under testdata/fuzz and fails at once.
    for try in 1 2; do
      if go test -run '^$' -fuzz "^${fn}\$" -fuzztime "$t" -fuzzminimizetime "${FUZZMINTIME:-2s}" "$pkg" >/tmp/polykv-fuzz.log 2>&1; then break; fi
      if [ "$try" = 1 ] && grep -q "context deadline exceeded" /tmp/polykv-fuzz.log && ! grep -q "Failing input written" /tmp/polykv-fuzz.log; then
        echo "fuzz $pkg $fn: coordinator deadline hiccup, running again"; continue
      fi
      cat /tmp/polykv-fuzz.log; exit 1
    done
  done
done
