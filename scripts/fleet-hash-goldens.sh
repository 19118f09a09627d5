#!/usr/bin/env bash
# Regenerates the golden block hashes of internal/kvevents/hash_test.go
# (TestBlockHashesMatchTheRouter) from llm-d-router's own token processor, so their
# provenance can be checked: run by hand, never by make test (it needs the router's
# source, which is not committed here, and its modules through the Go module proxy).
#
#   git clone https://github.com/llm-d/llm-d-router ~/src/llm-d-router
#   (cd ~/src/llm-d-router && git checkout ebab687927f5331c1b39defcb579a07951bce56c)
#   scripts/fleet-hash-goldens.sh ~/src/llm-d-router
#
# It builds a small program against the checkout's pkg/kvcache/kvblock
# (NewChunkedTokenDatabase, TokensToKVBlockKeys) in a temporary directory inside the
# checkout (removed afterwards), prints each case's keys as hash_test.go writes them, and
# exits 1 unless every line is in hash_test.go. The cases here and in hash_test.go are the
# same inputs; change both together.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pin=ebab687927f5331c1b39defcb579a07951bce56c # docs/fleet.md's llm-d-router commit
router=${1:?usage: scripts/fleet-hash-goldens.sh LLM_D_ROUTER_CHECKOUT}
router=$(cd "$router" && pwd)
head=$(git -C "$router" rev-parse HEAD)
if [ "$head" != "$pin" ]; then
	echo "fleet-hash-goldens: $router is at $head, the goldens are pinned to $pin (git checkout $pin there)" >&2
	exit 1
fi
tmp=$(mktemp -d "$router/polykv-goldens.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/main.go" <<'GO'
// The golden keys of PolyKV's internal/kvevents/hash_test.go, by llm-d-router's own code.
package main

import (
	"fmt"
	"strings"

	"github.com/llm-d/llm-d-router/pkg/kvcache/kvblock"
)

func keys(cfg *kvblock.TokenProcessorConfig, parent kvblock.BlockHash, tokens []uint32, model string) string {
	db, err := kvblock.NewChunkedTokenDatabase(cfg)
	if err != nil {
		panic(err)
	}
	ks, err := db.TokensToKVBlockKeys(parent, tokens, model, nil)
	if err != nil {
		panic(err)
	}
	var s []string
	for _, k := range ks {
		s = append(s, fmt.Sprintf("%#x", uint64(k)))
	}
	return "[]uint64{" + strings.Join(s, ", ") + "}"
}

func main() {
	toks := make([]uint32, 40)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	child := []uint32{100000, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 49151}
	def := kvblock.DefaultTokenProcessorConfig() // block size 16, seed "", cbor-fnv
	smol := keys(def, kvblock.EmptyBlockHash, toks, "smollm2")
	fmt.Printf("smollm2, tokens 1..40 %s\n", smol)
	fmt.Printf("gemma, tokens 1..40 %s\n", keys(def, kvblock.EmptyBlockHash, toks, "gemma"))
	// The child chains from smollm2's block 1 (its second key).
	var parent uint64
	fmt.Sscanf(strings.Split(strings.TrimSuffix(smol, "}"), ", ")[1], "%v", &parent)
	fmt.Printf("child of smollm2's block 1 (%#x) %s\n", parent, keys(def, kvblock.BlockHash(parent), child, "smollm2"))
	fmt.Printf("block size 8, seed 42, tokens 1..20 %s\n",
		keys(&kvblock.TokenProcessorConfig{BlockSizeTokens: 8, HashSeed: "42"}, kvblock.EmptyBlockHash, toks[:20], "smollm2"))
}
GO
out=$(cd "$router" && GOFLAGS=-mod=readonly go run "./$(basename "$tmp")")
echo "$out"
test=$root/internal/kvevents/hash_test.go
bad=0
while read -r line; do
	want=${line##* \[\]uint64}
	if ! grep -qF "[]uint64$want" "$test"; then
		echo "fleet-hash-goldens: not in $test: $line" >&2
		bad=1
	fi
done <<<"$out"
if grep -q "0xa059b46655748ab2," "$test" && ! grep -qF "(0xa059b46655748ab2)" <<<"$out"; then
	echo "fleet-hash-goldens: the child case's parent in $test is not the router's smollm2 block 1" >&2
	bad=1
fi
[ "$bad" = 0 ] && echo "fleet-hash-goldens: every key above is in $test"
exit "$bad"
