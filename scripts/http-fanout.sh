#!/usr/bin/env bash
# Fan-out through the HTTP servers, cold: N agents share a ROOT-token prefix, each adds its
# own SUFFIX tokens and decodes GEN tokens greedily; all N requests are sent at once to a
# freshly started server, as plain clients (no pool ids: PolyKV's automatic prefix sharing
# against llama-server's slots). For each N, llama-server (`-np N`, one slot per agent)
# then polykv serve (`-np N`), each with room for every agent's whole prompt, the same
# threads, batch and layers on the GPU (NGL). Prints per server and N the wall time from
# the first request sent to the last reply, the prompt tokens each server actually
# evaluated (sum of timings.prompt_n), the generated tokens per second over the wall time,
# and polykv's speed-up; one line per row, for docs/gpu.md and docs/benchmarks.md.
#
#   scripts/http-fanout.sh MODEL LLAMA_SERVER ["1 4 16 64"]
#   env: ROOT=2000 SUFFIX=100 GEN=128 THREADS=$(nproc) PORT=18432 POLYKV=bin/polykv,
#        NGL=99 (llama-server's -ngl) and PNGL=all (polykv's); NGL=0 PNGL=0 on a CPU
#
# A shell script, not a bench workload: it starts two programs and reads a few fields of
# their replies. Both servers come from the same pinned llama.cpp (llama-server from
# `make llama-tools`, loading lib/'s backend from its own directory on a GPU machine).
set -euo pipefail
model=${1:?usage: http-fanout.sh MODEL LLAMA_SERVER [AGENT_COUNTS]}
llama_server=${2:?usage: http-fanout.sh MODEL LLAMA_SERVER [AGENT_COUNTS]}
counts=${3:-1 4 16 64}
root_n=${ROOT:-2000} suffix_n=${SUFFIX:-100} gen=${GEN:-128}
ngl=${NGL:-99} pngl=${PNGL:-all} threads=${THREADS:-$(nproc)} port=${PORT:-18432}
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/scripts/http.sh" # no curl on the GPU machine's image, perhaps
polykv=${POLYKV:-$here/bin/polykv}
work=$(mktemp -d)

pid=
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; fi; pid=; }
trap 'stop; rm -rf "$work"' EXIT

# Token ids inside both test models' vocabularies: the root 100.., each agent's suffix 6000..
root=$(awk -v n="$root_n" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), 100 + (i * 37) % 5000 }')
body() { # agent index
	local suffix
	suffix=$(awk -v n="$suffix_n" -v a="$1" 'BEGIN { for (j = 0; j < n; j++) printf ",%d", 6000 + (a * 131 + j * 17) % 3000 }')
	printf '{"prompt": [%s%s], "n_predict": %d, "max_tokens": %d, "temperature": 0, "ignore_eos": true, "cache_prompt": true}' \
		"$root" "$suffix" "$gen" "$gen"
}

# field NAME FILE: the first numeric value of "NAME": in a reply.
field() { grep -o "\"$1\":[0-9.]*" "$2" | head -1 | cut -d: -f2; }

# run NAME N ROUTE COMMAND...: start the server, wait for /health, send the N requests at
# once, print the row.
run() {
	local name=$1 n=$2 route=$3
	shift 3
	"$@" >"$work/$name-$n.log" 2>&1 &
	pid=$!
	local up=
	for _ in $(seq 1200); do
		if http_ok "$port" /health; then up=1; break; fi
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if [ -z "$up" ]; then
		echo "$name N=$n: server did not come up; its log:" >&2
		tail -20 "$work/$name-$n.log" >&2
		stop
		return 1
	fi
	local t0 t1 i prompt=0 generated=0 failed=0
	t0=$(date +%s.%N)
	for i in $(seq "$n"); do
		http_post "$port" "$route" "$work/body.$i" "$work/out.$i" >"$work/code.$i" &
	done
	wait $(jobs -p | grep -v "^$pid\$") 2>/dev/null || true
	t1=$(date +%s.%N)
	for i in $(seq "$n"); do
		if [ "$(cat "$work/code.$i")" != 200 ]; then failed=$((failed + 1)); continue; fi
		prompt=$((prompt + $(field prompt_n "$work/out.$i")))
		generated=$((generated + $(field predicted_n "$work/out.$i")))
	done
	awk -v s="$name" -v n="$n" -v t0="$t0" -v t1="$t1" -v p="$prompt" -v g="$generated" -v f="$failed" \
		'BEGIN { w = t1 - t0; printf "%-12s N=%-3d wall %7.2f s  prompt tokens evaluated %7d  generated %6d (%.0f tok/s)  failed %d\n", s, n, w, p, g, g / w, f }' |
		tee -a "$work/rows"
	[ "$failed" = 0 ] || { echo "$name N=$n: a reply:" >&2; head -c 600 "$(grep -lv '^200$' "$work"/code.* | head -1 | sed 's/code/out/')" >&2; echo >&2; }
	stop
}

echo "model $(basename "$model"), root $root_n + suffix $suffix_n tokens per agent, $gen generated each, ngl $ngl, $threads threads"
for n in $counts; do
	for i in $(seq "$n"); do body "$i" >"$work/body.$i"; done
	cells=$((n * (root_n + suffix_n + gen + 64)))
	run llama-server "$n" /completion "$llama_server" -m "$model" --port "$port" -t "$threads" -ngl "$ngl" -fa on \
		-c "$cells" -np "$n" -b 2048 -ub 512 || true
	run polykv "$n" /completions "$polykv" serve -m "$model" --port "$port" -t "$threads" -ngl "$pngl" \
		-c "$cells" -np "$n" -b 2048 || true
	awk -v n="$n" '$2 == "N=" n || $2 ~ "^N=" n "$" { w[$1] = $4 } END { if (w["polykv"] > 0 && w["llama-server"] > 0) printf "N=%d: polykv %.2fx llama-server (wall time)\n", n, w["llama-server"] / w["polykv"] }' "$work/rows"
done
