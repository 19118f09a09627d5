package runner

import (
	"testing"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// TestDrafterCells: the draft context's cells, owned by the drafter's kvcache.Manager,
// on the real model drafting for itself. A pool's prefix is prefilled once and shared
// by seq_cp with its two sessions (counted once, and still once after the pool's own
// draft sequence is emptied: the sessions keep the cells they share); a rewound session
// keeps its common prefix; out of room, the sequences not drafting are evicted; an
// emptied sequence holds nothing. After every call the cell tree and the draft
// context agree on each sequence's length.
func TestDrafterCells(t *testing.T) {
	m := testModel(t)
	ctx, err := llama.NewContext(m, llama.ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 8, NThreads: 2, KVUnified: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctx.Free)
	d := NewDrafter(m, m, ctx, 0, nil)
	toks := func(s string) []llama.Token {
		out, err := m.Tokenize(s, false, true)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	const k, pool = 4, 6
	prefix := toks("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown")
	own := [][]llama.Token{toks(" fox jumps over"), toks(" cat sleeps under")}
	want := func(seq int, tail []llama.Token) engine.DraftWant {
		return engine.DraftWant{Task: engine.TaskID(seq), Seq: seq, Tokens: append(append([]llama.Token{}, prefix...), tail...), K: k, From: pool, Shared: len(prefix)}
	}
	check := func(when string, cells, seqs int) {
		t.Helper()
		c, s := d.Held()
		if c != cells || s != seqs {
			t.Errorf("%s: %d cells of %d sequences held, want %d of %d", when, c, s, cells, seqs)
		}
		for seq := range 8 {
			if got, llamaHas := d.held(seq), ctx.SeqPosMax(seq)+1; got != llamaHas {
				t.Errorf("%s: sequence %d holds %d cells, the draft context %d", when, seq, got, llamaHas)
			}
		}
	}
	props := d.Draft([]engine.DraftWant{want(0, own[0]), want(1, own[1])})
	if len(props) != 2 || len(props[0].Tokens) != k || len(props[1].Tokens) != k {
		t.Fatalf("proposals %v: want %d tokens for each session", props, k)
	}
	// Each session holds its tokens and its drafts but the last (never decoded).
	sess := func(i int) int { return len(prefix) + len(own[i]) + k - 1 }
	if n, want := d.Decoded(), int64(len(prefix)+sess(0)+sess(1)-2*len(prefix)); n != want {
		t.Errorf("decoded %d tokens, want %d (the pool's prefix once)", n, want)
	}
	check("two sessions on a pool", len(prefix)+sess(0)+sess(1)-2*len(prefix), 3)

	d.DraftSeqRm(pool)
	check("the pool emptied", len(prefix)+sess(0)+sess(1)-2*len(prefix), 2)

	// Session 0 rewinds to its second own token and goes on another way.
	w := want(0, append(own[0][:1:1], toks(" bird")...))
	d.Draft([]engine.DraftWant{w})
	check("a session rewound", len(prefix)+(len(w.Tokens)+k-1-len(prefix))+(sess(1)-len(prefix)), 2)

	// A long session alone: the others are evicted to make room.
	long := make([]llama.Token, 0, d.nCtx)
	for len(long) < d.nCtx-20 {
		long = append(long, prefix...)
	}
	long = long[:d.nCtx-20]
	if props := d.Draft([]engine.DraftWant{{Task: 2, Seq: 2, Tokens: long, K: k}}); len(props) != 1 {
		t.Fatalf("the long session drafted %v", props)
	}
	check("out of room", len(long)+k-1, 1)

	d.DraftSeqRm(2)
	check("every sequence emptied", 0, 0)
}
