#!/usr/bin/env bash
# The measured run of docs/fleet.md: the same agent workload (cmd/fleetbench) through
# the one-machine fleet of run.sh under each routing config (precise prefix, session
# affinity with load scorers, random), through one server alone for reference, and the
# fault scenario (a replica killed at half the requests, then restarted), and the shared
# level's part (issue 44: more teams than a replica's cache holds, the shared level off
# then on, then on with a replica restarted mid-run). Each config starts a fresh fleet,
# so no run inherits another's cache. Needs what run.sh needs (EPP_BIN, ENVOY). Prints a
# markdown table; logs go to WORK (artifacts/fleet-bench).
# BENCH_ARGS sizes the workload (default: 3 teams x 3 agents x 3 turns, ~500-token
# system prompts); THREADS per replica (1); PARTS (default "single configs fault"; also
# "shared") and CONFIGS (default "precise session random"; also "speculative") choose
# what runs. The shared part's workload is SHARED_BENCH_ARGS (default: 9 teams x 3
# agents x 3 turns, ~2,000-token system prompts) on replicas of SHARED_CTX cells (4096);
# SHARED_RUNS picks its runs (default "off on restart restart-off") and
# SHARED_EPP_CONFIG their router config (default deploy/local/epp-config.yaml).
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
  # A replica the shared part restarted, if the run stopped before it was taken over.
  [ -n "${pidfile:-}" ] && [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
  true
}
trap cleanup EXIT

# fleet_up CONFIG DIR: a fresh fleet with that EPP config, logs in DIR (CTX, SHARED_DIR
# from the caller: the replicas' context and shared level).
fleet_up() {
  LOGDIR="$2" EPP_CONFIG="$1" THREADS="$THREADS" EPP_ARGS="${EPP_ARGS:-}" CTX="${CTX:-4096}" SHARED_DIR="${SHARED_DIR:-}" \
    deploy/local/run.sh >"$2.out" 2>&1 &
  fleet=$!
  until grep -qs "fleet up" "$2.out"; do
    kill -0 "$fleet" 2>/dev/null || { cat "$2.out" >&2; exit 1; }
    sleep 1
  done
  sleep 2 # the EPP's subscribers connect and take their snapshots
}
fleet_down() { kill "$fleet"; wait "$fleet" || true; fleet=; }
# serve IP LOG: one replica as run.sh starts them.
serve() {
  POLYKV_MODEL="$MODEL" THREADS="$THREADS" CTX=4096 SHARED_DIR= deploy/local/replica.sh "$1" >"$2" 2>&1 &
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
if [[ " $PARTS " == *" fault "* ]]; then
# Faults: 127.0.0.3 is killed (SIGKILL, a crash) at half the requests; 2 s later it
# leaves the endpoint list (what a failing readiness probe does in Kubernetes), and the
# EPP drops its subscriber and its blocks. Then it restarts and rejoins.
EPP_ARGS=--v=4 fleet_up deploy/local/epp-config.yaml "$WORK/fault" # its debug log shows the subscriber removed
victim=$(cat "$WORK/fault/polykv-127.0.0.3.pid")
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
kill "$extra"; wait "$extra" || true; extra=
fi

# The shared level (issue 44, parts (b) and (c)), precise config throughout: the same
# workload, more teams than one replica's cache holds, through a fresh fleet with the
# shared level off, then a fresh fleet sharing a fresh empty directory, then (c) a fresh
# fleet on another fresh directory where 127.0.0.3 is killed (SIGKILL: a crash, so
# nothing is saved at exit; what it finds later was written through while requests
# ended) when half the turns are done and restarted at once on the same addresses with
# the same directory and an empty cache. It stays in the EPP's endpoint list (a
# supervisor restarting a crashed server in place): requests routed to it meanwhile
# fail and are retried (up to 5 times here, 1 s apart). Last, the same restart with the
# shared level off: the control, where the restarted replica can only prefill.
if [[ " $PARTS " == *" shared "* ]]; then
  read -r -a SARGS <<<"${SHARED_BENCH_ARGS:--teams 9 -agents 3 -turns 3 -system-words 1400 -max-tokens 16}"
  sctx=${SHARED_CTX:-4096}
  scfg=${SHARED_EPP_CONFIG:-deploy/local/epp-config.yaml}
  sbench() { bin/fleetbench "${SARGS[@]}" -replicas "$REPLICAS" "$@" | tee -a "$TABLE"; }
  # level DIR: what the shared directory holds.
  level() { echo "shared level $1: $(find "$1" -maxdepth 1 -name "*.kv" -type f | wc -l) entries, $(du -sm "$1" | cut -f1) MB"; }
  # tiermetrics IP: the replica's tier counters (what it loaded instead of prefilling).
  tiermetrics() {
    curl -s "http://$1:8000/metrics" | grep -E '^polykv_(tier_(loaded_tokens|loads|segment_misses)_total|prefix_cache_hits_total|queries_total)' | tr '\n' ' '
  }
  runs=" ${SHARED_RUNS:-off on restart restart-off} " # which runs
  if [[ $runs == *" off "* ]]; then
    CTX=$sctx fleet_up "$scfg" "$WORK/shared-off"
    sbench -label "shared level off" -records "$WORK/shared-off/turns.jsonl"
    fleet_down
  fi
  if [[ $runs == *" on "* ]]; then
    dir=$WORK/shared-on/level
    rm -rf "$dir"
    CTX=$sctx SHARED_DIR=$dir fleet_up "$scfg" "$WORK/shared-on"
    sbench -label "shared level on" -records "$WORK/shared-on/turns.jsonl"
    level "$dir" | tee -a "$TABLE"
    fleet_down
  fi
  # restart_run NAME SHARED(on|off): the restart scenario, on a fresh directory when
  # SHARED is on; off is the control (the restarted replica can only prefill).
  restart_run() {
    local w=$WORK/$1 dir= label="shared level $2, 127.0.0.3 restarted"
    pidfile=$w/restarted.pid
    rm -rf "$w/level" "$pidfile"
    [ "$2" = off ] || dir=$w/level
    CTX=$sctx SHARED_DIR=$dir fleet_up "$scfg" "$w"
    local victim restart
    victim=$(cat "$w/polykv-127.0.0.3.pid")
    restart="kill -9 $victim; sleep 0.5;"
    [ -z "$dir" ] || restart+=" level $dir >&2;"
    restart+=" POLYKV_MODEL=$MODEL THREADS=$THREADS CTX=$sctx SHARED_DIR=$dir deploy/local/replica.sh 127.0.0.3"
    restart+=" >$w/polykv-127.0.0.3-restarted.log 2>&1 & echo \$! >$pidfile;"
    restart+=" for _ in \$(seq 300); do curl -sf -o /dev/null http://127.0.0.3:8000/health && break; sleep 0.2; done"
    sbench -label "$label" -retries 5 -fault "$restart" -fault-replica 127.0.0.3:8000 -records "$w/turns.jsonl"
    extra=$(cat "$pidfile")
    echo "restarted 127.0.0.3 ($2): $(tiermetrics 127.0.0.3)" | tee -a "$TABLE"
    [ -z "$dir" ] || level "$dir" | tee -a "$TABLE"
    fleet_down
    kill "$extra" 2>/dev/null || true
    wait "$extra" 2>/dev/null || true # not bench.sh's child: wait says so
    while kill -0 "$extra" 2>/dev/null; do sleep 0.2; done
    rm -f "$pidfile"
    extra=
  }
  export -f level
  if [[ $runs == *" restart "* ]]; then restart_run shared-restart on; fi
  if [[ $runs == *" restart-off "* ]]; then restart_run shared-restart-off off; fi
fi
echo "table: $TABLE"
