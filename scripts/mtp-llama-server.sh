#!/usr/bin/env bash
# llama.cpp's own MTP drafting (llama-server --spec-type draft-mtp) on the MTP test model
# (scripts/qwen35mtp-testmodel.cpp, ~/.cache/polykv/testmodels/qwen35mtp.gguf): for each
# prompt, greedy output with speculation off and with draft-mtp at each --spec-draft-n-max
# in DRAFT_MAX, one fresh server per setting; prints draft_n / draft_n_accepted per reply
# and whether the tokens equal the non-speculative ones. Exit status 1 if any differ.
# PARALLEL=1: the prompts go in at once to a server with one slot each (-np 4), so the
# MTP context drafts and catches up for four sequences in the same batches.
#
#   scripts/mtp-llama-server.sh [LLAMA_SERVER] [MODEL]
#
# llama-server comes from `make llama-tools`. docs/speculative.md (MTP) has the figures.
# A shell script, not a Go test: it checks llama.cpp's driver, not PolyKV.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
llama_server=${1:-$("$root/scripts/llama.sh" dir)-tools/bin/llama-server}
model=${2:-${POLYKV_CACHE:-$HOME/.cache/polykv}/testmodels/qwen35mtp.gguf}
port=${PORT:-18437}
n_predict=${N_PREDICT:-64}
draft_max=${DRAFT_MAX:-1 3}

# Four prompts of token ids inside the model's 128-token vocabulary.
prompts=(
	"$(awk 'BEGIN { for (i = 0; i < 16; i++) printf "%s%d", (i ? "," : ""), 4 + (i * 37) % 120 }')"
	"$(awk 'BEGIN { for (i = 0; i < 48; i++) printf "%s%d", (i ? "," : ""), 4 + (i * 11) % 120 }')"
	"$(awk 'BEGIN { for (i = 0; i < 8; i++) printf "%s%d", (i ? "," : ""), 100 + i }')"
	"$(awk 'BEGIN { for (i = 0; i < 100; i++) printf "%s%d", (i ? "," : ""), 4 + (i * i) % 120 }')"
)

pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
trap stop EXIT
out=$(mktemp -d)
trap 'stop; rm -rf "$out"' EXIT

# run NAME ARGS...: one server, every prompt once; replies in $out/NAME.<i>.json.
run() {
	local name=$1 i
	shift
	local np=1
	[ "${PARALLEL:-0}" = 1 ] && np=${#prompts[@]}
	"$llama_server" -m "$model" -c $((2048 * np)) -np "$np" -t 2 --port "$port" "$@" >"$out/$name.log" 2>&1 &
	pid=$!
	for _ in $(seq 300); do
		curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
		kill -0 "$pid" 2>/dev/null || { tail -5 "$out/$name.log" >&2; exit 1; }
		sleep 0.1
	done
	local reqs=()
	for i in "${!prompts[@]}"; do
		curl -sf "http://127.0.0.1:$port/completion" -H 'Content-Type: application/json' \
			-d "{\"prompt\":[${prompts[$i]}],\"n_predict\":$n_predict,\"temperature\":0,\"return_tokens\":true,\"cache_prompt\":false}" \
			>"$out/$name.$i.json" &
		reqs+=($!)
		[ "${PARALLEL:-0}" = 1 ] || wait "$!"
	done
	wait "${reqs[@]}"
	stop
}

run base
for n in $draft_max; do
	run "mtp$n" --spec-type draft-mtp --spec-draft-n-max "$n"
done
python3 - "$out" "${#prompts[@]}" $draft_max <<'EOF'
import json, sys
out, n_prompts, ns = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
bad = 0
for n in ns:
    drafted = accepted = 0
    for i in range(n_prompts):
        base = json.load(open(f"{out}/base.{i}.json"))
        mtp = json.load(open(f"{out}/mtp{n}.{i}.json"))
        t = mtp["timings"]
        same = base["tokens"] == mtp["tokens"]
        bad += not same
        drafted += t.get("draft_n", 0)
        accepted += t.get("draft_n_accepted", 0)
        print(f"draft-max {n} prompt {i}: {len(mtp['tokens'])} tokens, draft_n {t.get('draft_n')}, "
              f"draft_n_accepted {t.get('draft_n_accepted')}, same as no speculation: {same}")
    print(f"draft-max {n}: acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.3f}")
sys.exit(1 if bad else 0)
EOF
