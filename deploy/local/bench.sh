#!/usr/bin/env bash
# The measured run of docs/fleet.md: the same agent workload (cmd/fleetbench) through
# the one-machine fleet of run.sh under each routing config (precise prefix, session
# affinity with load scorers, random), through one server alone for reference, and the
# fault scenario (a replica killed at half the requests, then restarted). Each config
# starts a fresh fleet, so no run inherits another's cache. Needs what run.sh needs
# (EPP_BIN, ENVOY). Prints a markdown table; logs go to WORK (artifacts/fleet-bench).
# BENCH_ARGS sizes the workload (default: 3 teams x 3 agents x 3 turns, ~500-token
# system prompts); THREADS per replica (1); PARTS (default "single configs fault") and
# CONFIGS (default "precise session random"; also "speculative") choose what runs.
# Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${EPP_BIN:?set EPP_BIN (see docs/fleet.md)}"
WORK=${WORK:-artifacts/fleet-bench}
THREADS=${THREADS:-1}
read -r -a ARGS <<<"${BENCH_ARGS:--teams 3 -agents 3 -turns 3 -system-words 350 -max-tokens 16}"
PARTS=${PARTS:-single configs fault}
CONFIGS=${CONFIGS:-precise session random}
REPLICAS=127.0.0.2:8000,127.0.0.3:8000,127.0.0.4:8000
MODEL=${POLYKV_MODEL:-$HOME/.cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$WORK"
go build -o bin/fleetbench ./cmd/fleetbench
TABLE="$WORK/table.md"
bin/fleetbench -header-only >"$TABLE"
fleet=
extra=
cleanup() {
  [ -n "$fleet" ] && kill "$fleet" 2>/dev/null && wait "$fleet" 2>/dev/null
  [ -n "$extra" ] && kill "$extra" 2>/dev/null && wait "$extra" 2>/dev/null
  true
}
trap cleanup EXIT

# fleet_up CONFIG DIR: a fresh fleet with that EPP config, logs in DIR.
fleet_up() {
  LOGDIR="$2" EPP_CONFIG="$1" THREADS="$THREADS" EPP_ARGS="${EPP_ARGS:-}" deploy/local/run.sh >"$2.out" 2>&1 &
  fleet=$!
  until grep -q "fleet up" "$2.out"; do
    kill -0 "$fleet" 2>/dev/null || { cat "$2.out" >&2; exit 1; }
    sleep 1
  done
  sleep 2 # the EPP's subscribers connect and take their snapshots
}
fleet_down() { kill "$fleet"; wait "$fleet" || true; fleet=; }
# serve IP LOG: one replica as run.sh starts them.
serve() {
  bin/polykv serve -m "$MODEL" --alias smollm2 --host "$1" --port 8000 -c 4096 --parallel 4 -t "$THREADS" \
    --kv-events-endpoint "tcp://$1:5557" --kv-block-size 16 --kv-events-pod-id "$1:8000" >"$2" 2>&1 &
  extra=$!
  until curl -sf -o /dev/null "http://$1:8000/health"; do sleep 0.5; done
}
bench() { bin/fleetbench "${ARGS[@]}" -replicas "$REPLICAS" "$@" | tee -a "$TABLE"; }

# One server alone: the hit ratio routing should approach.
if [[ " $PARTS " == *" single "* ]]; then
  serve 127.0.0.5 "$WORK/single.log"
  bin/fleetbench "${ARGS[@]}" -url http://127.0.0.5:8000 -replicas 127.0.0.5:8000 -label "one server" | tee -a "$TABLE"
  kill "$extra"; wait "$extra" || true; extra=
fi

declare -A file=([precise]=epp-config [session]=epp-session [random]=epp-random [speculative]=epp-speculative)
if [[ " $PARTS " == *" configs "* ]]; then
  for name in $CONFIGS; do
    fleet_up "deploy/local/${file[$name]}.yaml" "$WORK/$name"
    bench -label "$name"
    fleet_down
  done
fi
[[ " $PARTS " == *" fault "* ]] || exit 0

# Faults: 127.0.0.3 is killed (SIGKILL, a crash) at half the requests; 2 s later it
# leaves the endpoint list (what a failing readiness probe does in Kubernetes), and the
# EPP drops its subscriber and its blocks. Then it restarts and rejoins.
EPP_ARGS=--v=4 fleet_up deploy/local/epp-config.yaml "$WORK/fault" # its debug log shows the subscriber removed
victim=$(pgrep -f -- "--host 127.0.0.3 --port 8000")
without="$WORK/fault/endpoints-without.yaml"
awk '/name: polykv-1/{skip=4} skip>0{skip--; next} {print}' deploy/local/endpoints.yaml >"$without"
bench -label "precise, 127.0.0.3 killed" \
  -fault "kill -9 $victim; sleep 2; cp $without $WORK/fault/endpoints.tmp && mv $WORK/fault/endpoints.tmp $WORK/fault/endpoints.yaml"
serve 127.0.0.3 "$WORK/fault/polykv-127.0.0.3-restarted.log"
cp deploy/local/endpoints.yaml "$WORK/fault/endpoints.tmp" && mv "$WORK/fault/endpoints.tmp" "$WORK/fault/endpoints.yaml"
sleep 3 # the EPP discovers it again and subscribes: the restarted replica's snapshot
# New teams (system prompts no replica holds), so the cold replica competes on equal
# terms: traffic returns to it.
bench -label "precise, after the restart" -team-base 3
m=$(curl -s http://127.0.0.3:8000/metrics)
echo "restarted 127.0.0.3: $(grep -E '^polykv_kv_events_(messages|snapshots)_total' <<<"$m" | tr '\n' ' ')" | tee -a "$TABLE"
removed=$(grep -c "Removed KV-events subscriber" "$WORK/fault/epp.log" || true)
echo "EPP: $removed KV-events subscriber removed (its index entries cleared with it)" | tee -a "$TABLE"
fleet_down
echo "table: $TABLE"
