package runner

import (
	"bytes"
	"testing"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/testmodel"
)

// A copy taken from a sequence whose rejected drafts were just rolled back (a pool
// snapshotted from a speculating session before its next decode) must get the
// rolled-back recurrent state: llama.cpp's seq_cp shares the state cell but not the
// per-sequence snapshot index, so without Backend.SeqCp settling the rollback first the
// copy would carry the state with the rejected drafts in it.
func TestSeqCpAfterRecurrentRollback(t *testing.T) {
	llama.Init()
	m, err := llama.LoadModel(testmodel.Arch(t, "qwen35"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	ctx, err := llama.NewContext(m, llama.ContextParams{NCtx: 256, NBatch: 64, NUBatch: 64, NSeqMax: 4,
		NThreads: 2, KVUnified: true, RSSeq: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctx.Free)
	if ctx.RSSeq() < 3 {
		t.Fatalf("qwen35 context kept n_rs_seq %d, want ≥ 3", ctx.RSSeq())
	}
	b := NewBackend(m, ctx, nil)
	decode := func(seq, from int, toks ...engine.Token) { decodeAt(t, b, seq, from, toks...) }
	// state is seq's recurrent state as llama.cpp saves it, less the header (a tag and
	// the sequence id, which differ between a sequence and its copy).
	state := func(seq int) []byte {
		t.Helper()
		s, err := ctx.SeqPartialStateGet(seq)
		if err != nil {
			t.Fatal(err)
		}
		if len(s) < 8 || s[4] != byte(seq) {
			t.Fatalf("sequence %d's state does not start with its id: % x", seq, s[:min(len(s), 8)])
		}
		return s[8:]
	}
	decode(0, 0, 5, 9, 17, 33, 8, 21, 40, 7, 12, 60) // positions 0..9
	decode(0, 10, 11, 70, 23)                        // a token and two drafts: 10..12
	drafted := state(0)
	if !b.SeqRm(0, 11, -1) { // the two drafts rejected: rolled back
		t.Fatal("rollback of two positions refused")
	}
	want := state(0) // read through the snapshot index: the state after position 10
	if bytes.Equal(want, drafted) {
		t.Fatal("the rollback did not change the recurrent state: the test checks nothing")
	}
	b.SeqCp(0, 1, 0, -1)
	if got := state(1); !bytes.Equal(got, want) {
		t.Fatalf("the copy of a rolled-back sequence has another recurrent state (the one before the rollback: %v)", bytes.Equal(got, drafted))
	}
	if p := ctx.SeqPosMax(1); p != 10 {
		t.Fatalf("copy ends at position %d, want 10", p)
	}
}

// decodeAt decodes toks at positions from, from+1, … of seq through b, sampling none.
func decodeAt(t testing.TB, b *Backend, seq, from int, toks ...engine.Token) {
	t.Helper()
	batch := make([]engine.BatchEntry, len(toks))
	for i, tok := range toks {
		batch[i] = engine.BatchEntry{Token: tok, Pos: from + i, Seq: seq}
	}
	if _, err := b.Decode(batch); err != nil {
		t.Fatal(err)
	}
}
