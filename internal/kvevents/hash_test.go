package kvevents

import (
	"slices"
	"testing"
)

// TestBlockHashesMatchTheRouter: golden keys printed by llm-d-router's own token
// processor (pkg/kvcache/kvblock, NewChunkedTokenDatabase, TokensToKVBlockKeys) at
// commit ebab687927f5331c1b39defcb579a07951bce56c on the inputs below. The default
// config (block size 16, seed "", cbor-fnv) unless noted. scripts/fleet-hash-goldens.sh
// regenerates them from a checkout of the router at that commit and checks every key is
// here (run by hand: the router's source is not committed); the cases there and here
// are the same inputs, changed together.
func TestBlockHashesMatchTheRouter(t *testing.T) {
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32(i + 1)
	}
	cases := []struct {
		name   string
		parent uint64
		tokens []int32
		bs     int
		want   []uint64
	}{
		{"smollm2, tokens 1..40", InitHash("", "smollm2"), toks, 16, []uint64{0xb8f17822e39243a4, 0xa059b46655748ab2}},
		{"gemma, tokens 1..40", InitHash("", "gemma"), toks, 16, []uint64{0x50e8e3f95f3a6d35, 0x853468a88cdac09a}},
		{"child of smollm2's block 1", 0xa059b46655748ab2,
			[]int32{100000, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 49151}, 16, []uint64{0x46d7dbb797c99a17}},
		{"block size 8, seed 42, tokens 1..20", InitHash("42", "smollm2"), toks[:20], 8, []uint64{0x493126231b3f1047, 0xf97b1702c29496c3}},
	}
	for _, c := range cases {
		if got := BlockHashes(c.parent, c.tokens, c.bs); !slices.Equal(got, c.want) {
			t.Errorf("%s: %#x, want %#x", c.name, got, c.want)
		}
	}
}
