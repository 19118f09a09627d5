#!/usr/bin/env bash
# Prefill through the HTTP servers: llama-server (POST /completion) and polykv serve
# (POST /completions), each started fresh per measurement, alternating ROUNDS times, one
# N-token prompt given as token ids with cache_prompt false and one generated token;
# prints each server's timings.prompt_per_second. Both run 2 threads, a 4096-cell
# context, batch = ubatch = 512, flash attention on, one slot for llama-server.
#
#   scripts/http-prefill.sh MODEL LLAMA_SERVER [ROUNDS]   (N_TOKENS=2000 by default)
#
# llama-server comes from `make llama-tools` (the same pinned llama.cpp); polykv from
# `make build`. docs/benchmarks.md has the figures. A shell script, not a bench
# workload: it only starts two programs and reads one field of their replies.
set -euo pipefail
model=${1:?usage: http-prefill.sh MODEL LLAMA_SERVER [ROUNDS]}
llama_server=${2:?usage: http-prefill.sh MODEL LLAMA_SERVER [ROUNDS]}
rounds=${3:-3}
n=${N_TOKENS:-2000}
port=${PORT:-18431}
root=$(cd "$(dirname "$0")/.." && pwd)
polykv=$root/bin/polykv

# Token ids 100..5099 in a fixed scattered order: inside both test models' vocabularies.
prompt=$(awk -v n="$n" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), 100 + (i * 37) % 5000 }')

pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
trap stop EXIT

# measure NAME ROUTE COMMAND...: start the server, wait for /health, post the prompt once.
measure() {
	local name=$1 route=$2
	shift 2
	"$@" >/tmp/http-prefill-$name.log 2>&1 &
	pid=$!
	for _ in $(seq 600); do
		curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
		sleep 0.1
	done
	local out
	out=$(curl -sf "http://127.0.0.1:$port$route" -H 'Content-Type: application/json' \
		-d "{\"prompt\": [$prompt], \"n_predict\": 1, \"max_tokens\": 1, \"cache_prompt\": false, \"temperature\": 0}")
	printf '%s %s tok/s\n' "$name" "$(jq -r '.timings.prompt_per_second' <<<"$out")"
	stop
}

echo "model $(basename "$model"), $n prompt tokens, $rounds rounds"
for _ in $(seq "$rounds"); do
	measure llama-server /completion "$llama_server" -m "$model" --port "$port" -t 2 -fa on -c 4096 -b 512 -ub 512 -np 1
	measure polykv /completions "$polykv" serve -m "$model" --port "$port" -t 2 -c 4096 -b 512
done
