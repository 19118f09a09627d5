#!/usr/bin/env bash
# One replica of the one-machine fleet, as run.sh and bench.sh start them (and as
# bench.sh restarts one on the same address): replica.sh IP. It execs bin/polykv, so
# its process id is the server's (a kill of it is a kill of the server).
# Environment: POLYKV_MODEL, THREADS (1), CTX (context cells, 4096), SHARED_DIR (the
# shared level, --tier-shared-dir, for every replica of a fleet; unset: none) and
# SHARED_MB (its budget, --tier-shared-mb; unset: the server's default). Run from the
# repository root.
set -euo pipefail
ip=${1:?usage: replica.sh IP}
MODEL=${POLYKV_MODEL:-$HOME/.cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf}
args=()
if [ -n "${SHARED_DIR:-}" ]; then
  args+=(--tier-shared-dir "$SHARED_DIR")
  [ -z "${SHARED_MB:-}" ] || args+=(--tier-shared-mb "$SHARED_MB")
fi
# The pod id is what the EPP keys this replica's events by: the address it dials.
exec bin/polykv serve -m "$MODEL" --alias smollm2 --host "$ip" --port 8000 -c "${CTX:-4096}" --parallel 4 \
  -t "${THREADS:-1}" --kv-events-endpoint "tcp://$ip:5557" --kv-block-size 16 --kv-events-pod-id "$ip:8000" \
  "${args[@]}"
