package runner

import (
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/testmodel"
)

// TestMTPDraftsMatchReference: the MTP drafter's proposals, with its context kept by
// mirroring the backend's operations (a pool prefilled once and copied into two
// sessions, each decoding its own suffix, a verify batch cut back by a rejected draft,
// the rollback of the hybrid target), equal what a fresh MTP context gives when it is
// fed the whole context at once with the target's hidden state of every position (the
// draft-mtp recipe in docs/speculative-log.md). Losslessness does not depend on this (the
// target verifies every draft); acceptance does: an h paired with the wrong position
// would still pass the server tests.
func TestMTPDraftsMatchReference(t *testing.T) {
	llama.Init()
	m, err := llama.LoadModelWith(testmodel.Arch(t, "qwen35mtp"), llama.ModelParams{LoadMTP: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	const k = 3
	tgt, err := llama.NewContext(m, llama.ContextParams{NCtx: 512, NBatch: 64, NUBatch: 64, NSeqMax: 4,
		NThreads: 2, KVUnified: true, RSSeq: k})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tgt.Free)
	tgt.SetEmbeddingsNextN(true, false)
	mctx, err := llama.NewContext(m, llama.ContextParams{NCtx: 512, NBatch: 64, NUBatch: 64, NSeqMax: 4,
		NThreads: 2, KVUnified: true, MTPTarget: tgt})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mctx.Free)
	mctx.SetEmbeddingsNextN(true, true)
	mtp, err := NewMTP(m, tgt, mctx, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	mtp.CheckMirror(4)
	b := NewBackend(m, tgt, nil)
	b.EnableDrafter(mtp)

	decode := func(seq, from int, toks []engine.Token) { decodeAt(t, b, seq, from, toks...) }
	toks := mtpTestTokens
	draft := func(wants ...engine.DraftWant) map[engine.TaskID][]engine.Token { return draftsByTask(mtp, wants) }
	check := func(name string, got []engine.Token, ctxToks []engine.Token) {
		t.Helper()
		want := mtpReference(t, m, ctxToks, k)
		if !slices.Equal(got, want) {
			t.Errorf("%s: MTP drafted %v, a fresh MTP context over the same context %v", name, got, want)
		}
	}

	pool := toks(1, 40)
	decode(2, 0, pool)
	s0 := append(slices.Clone(pool), toks(2, 10)...)
	s1 := append(slices.Clone(pool), toks(3, 7)...)
	b.SeqCp(2, 0, 0, len(pool))
	b.SeqCp(2, 1, 0, len(pool))
	decode(0, len(pool), s0[len(pool):])
	decode(1, len(pool), s1[len(pool):])
	next0, next1 := engine.Token(44), engine.Token(17)
	w0 := append(slices.Clone(s0), next0)
	w1 := append(slices.Clone(s1), next1)
	got := draft(engine.DraftWant{Task: 1, Seq: 0, Tokens: w0, K: k}, engine.DraftWant{Task: 2, Seq: 1, Tokens: w1, K: k})
	check("session 0 on the pool", got[1], w0)
	check("session 1 on the pool", got[2], w1)
	if len(got[1]) != k {
		t.Fatalf("session 0: %d drafts, want %d (p-min 0)", len(got[1]), k)
	}

	// Verify session 0's drafts; the second is rejected: the target keeps the next
	// token and the first draft, and goes on with another token.
	decode(0, len(s0), append([]engine.Token{next0}, got[1]...))
	if !b.SeqRm(0, len(s0)+2, -1) {
		t.Fatal("rollback of the rejected drafts refused")
	}
	w0 = append(append(slices.Clone(s0), next0, got[1][0]), 9)
	got = draft(engine.DraftWant{Task: 1, Seq: 0, Tokens: w0, K: k})
	check("session 0 after a rejected draft", got[1], w0)
	// And after all were accepted.
	decode(0, len(w0)-1, append([]engine.Token{w0[len(w0)-1]}, got[1]...))
	w0 = append(append(slices.Clone(w0), got[1]...), 30)
	got = draft(engine.DraftWant{Task: 1, Seq: 0, Tokens: w0, K: k})
	check("session 0 after accepted drafts", got[1], w0)

	if n, first := mtp.Mismatches(); n > 0 {
		t.Errorf("the MTP context's cells left the target's %d times; first %s", n, first)
	}
	if g := mtp.Gaps(); g > 0 {
		t.Errorf("%d entries mirrored without their hidden state", g)
	}
}

// mtpReference drafts k tokens after toks (context and next token) the plain way: a
// fresh target decodes the context in one batch, a fresh MTP context is fed each token
// with the target's row of the position before, then drafts greedily on its own rows.
// The catch-up and the first draft entry are two decodes, as in llama.cpp's driver (and
// runner.MTP): in one batch, the first draft's row for the next step comes out wrong in
// b11434 (with masked NextN rows, its decode copies the head's first n_outputs rows, not
// the rows of the entries that asked for output; src/llama-context.cpp, the nextn
// extraction in decode), which made the drafts after the first differ here.
func mtpReference(t *testing.T, m *llama.Model, toks []engine.Token, k int) []engine.Token {
	t.Helper()
	n := len(toks) - 1
	tgt, d := refContexts(t, m, m, llama.ContextParams{NCtx: 512, NBatch: 128, NUBatch: 128, NSeqMax: 1, NThreads: 2, KVUnified: true}, toks[:n])
	d.BatchClear()
	h := make([]float32, m.NEmbdOut())
	for i, tok := range toks {
		if i == n {
			if err := d.Decode(); err != nil {
				t.Fatal(err)
			}
			d.BatchClear()
		}
		if _, err := d.BatchAddEmbd(tok, i, 0, i == n, h); err != nil {
			t.Fatal(err)
		}
		if i < n {
			h = tgt.EmbeddingsNextN(i)
		}
	}
	var out []engine.Token
	for {
		if err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		i := d.BatchLen() - 1
		tok, _, ok := d.Greedy(i, m.NVocab())
		if !ok {
			t.Fatal("no logits for the draft row")
		}
		out = append(out, tok)
		if len(out) == k {
			return out
		}
		row := d.EmbeddingsNextN(i)
		d.BatchClear()
		if _, err := d.BatchAddEmbd(tok, n+len(out), 0, true, row); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAssistantDraftsMatchReference: drafts of an MTP assistant (Gemma 4's, a model file
// of its own reading the target's cells: scripts/gemma4assistant-testmodel.cpp, whose
// drafts depend on the hidden state it is given) over a backend's sequences (a pool
// copied into two sessions, each decoding its own suffix; a verify batch cut back by a
// rejected draft) equal what a fresh assistant gives over a fresh target that decoded the
// same context in one batch. The rows MTP keeps (the last entry's, the sampled ones') must
// be those of the right positions: losslessness does not depend on it, acceptance does.
func TestAssistantDraftsMatchReference(t *testing.T) {
	llama.Init()
	m, err := llama.LoadModel(testmodel.Arch(t, "gemma4q"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	am, err := llama.LoadModel(testmodel.Arch(t, "gemma4assistant"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(am.Free)
	const k = 3
	// Every position stays within the 32-token window, which the sequences below never leave.
	tgt, actx := refContexts(t, m, am, llama.ContextParams{NCtx: 256, NBatch: 64, NUBatch: 64, NSeqMax: 4, NThreads: 2, KVUnified: true, SWAFull: true}, nil)
	if !actx.SharesTargetKV() {
		t.Fatal("the assistant's context does not read the target's cells")
	}
	mtp, err := NewMTP(m, tgt, actx, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := NewBackend(m, tgt, nil)
	b.EnableDrafter(mtp)

	draft := func(wants ...engine.DraftWant) map[engine.TaskID][]engine.Token { return draftsByTask(mtp, wants) }
	// check compares seq's drafts, and the row MTP keeps for its last position, with the
	// reference's: the drafts of this test model depend on the row only a little (its
	// successor map dominates), so the row itself is compared, bit for bit (the target's
	// kernels give a position's row whatever the batch).
	check := func(name string, seq int, got []engine.Token, ctxToks []engine.Token) {
		t.Helper()
		want, row := assistantReference(t, m, am, ctxToks, k)
		if !slices.Equal(got, want) {
			t.Errorf("%s: the assistant drafted %v, a fresh one over the same context %v", name, got, want)
		}
		if kept := mtp.row(seq, len(ctxToks)-2); !slices.Equal(kept, row) {
			t.Errorf("%s: the row kept for position %d is not the target's of that position", name, len(ctxToks)-2)
		}
		t.Logf("%s: drafted %v", name, got)
	}

	pool, s0, s1 := poolSessions(t, b, 16)
	next0, next1 := engine.Token(44), engine.Token(17)
	w0 := append(slices.Clone(s0), next0)
	w1 := append(slices.Clone(s1), next1)
	got := draft(engine.DraftWant{Task: 1, Seq: 0, Tokens: w0, K: k}, engine.DraftWant{Task: 2, Seq: 1, Tokens: w1, K: k})
	check("session 0 on the pool", 0, got[1], w0)
	check("session 1 on the pool", 1, got[2], w1)
	if len(got[1]) != k {
		t.Fatalf("session 0: %d drafts, want %d (p-min 0)", len(got[1]), k)
	}

	// Verify session 0's drafts as the engine does (every entry sampled); the second is
	// rejected: the target keeps the next token and the first draft, then another token.
	b.NewSampler(1, engine.SamplingParams{}, false, nil)
	defer b.FreeSampler(1)
	verify := []engine.BatchEntry{{Token: next0, Pos: len(s0), Seq: 0, Sample: true, Task: 1}}
	for i, d := range got[1] {
		verify = append(verify, engine.BatchEntry{Token: d, Pos: len(s0) + 1 + i, Seq: 0, Sample: true, Task: 1, Draft: true})
	}
	if _, err := b.Decode(verify); err != nil {
		t.Fatal(err)
	}
	if !b.SeqRm(0, len(s0)+2, -1) {
		t.Fatal("rollback of the rejected drafts refused")
	}
	w0 = append(append(slices.Clone(s0), next0, got[1][0]), 9)
	got = draft(engine.DraftWant{Task: 1, Seq: 0, Tokens: w0, K: k})
	check("session 0 after a rejected draft", 0, got[1], w0)
	// A sequence whose last position's row is not kept (a copy of another's prefix, no
	// decode of its own yet) is not drafted for.
	b.SeqCp(2, 3, 0, 10)
	if got := draft(engine.DraftWant{Task: 3, Seq: 3, Tokens: append(slices.Clone(pool[:10]), 5), K: k}); len(got) != 0 {
		t.Errorf("drafted %v for a sequence with no row of its last position", got)
	}
}

// assistantReference drafts k tokens after toks (context and next token) the plain way: a
// fresh target decodes the context in one batch, a fresh assistant reads the next token
// with the target's row of the last position, then each drafted token with its own row,
// all at the next token's position (llama.cpp's driver with a shared cache). It returns
// the drafts and the target's row of the last position.
func assistantReference(t *testing.T, m, am *llama.Model, toks []engine.Token, k int) ([]engine.Token, []float32) {
	t.Helper()
	n := len(toks) - 1
	tgt, d := refContexts(t, m, am, llama.ContextParams{NCtx: 256, NBatch: 64, NUBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, SWAFull: true}, toks[:n])
	row := tgt.EmbeddingsNextN(n - 1)
	tok, h := toks[n], row
	var out []engine.Token
	for len(out) < k {
		d.BatchClear()
		if _, err := d.BatchAddEmbd(tok, n, 0, true, h); err != nil {
			t.Fatal(err)
		}
		if err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		var ok bool
		if tok, _, ok = d.Greedy(0, m.NVocab()); !ok {
			t.Fatal("no logits for the draft row")
		}
		out = append(out, tok)
		h = d.EmbeddingsNextN(0)
	}
	return out, row
}

// refContexts is a fresh target context on m (parameters p, NextN rows of every entry on)
// that has decoded ctxToks in one batch (if any), and a fresh MTP context over it on dm
// (m itself or an assistant; masked NextN rows), both freed when the test ends.
func refContexts(t *testing.T, m, dm *llama.Model, p llama.ContextParams, ctxToks []engine.Token) (tgt, d *llama.Context) {
	t.Helper()
	tgt, err := llama.NewContext(m, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tgt.Free)
	tgt.SetEmbeddingsNextN(true, false)
	p.MTPTarget = tgt
	if d, err = llama.NewContext(dm, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Free)
	d.SetEmbeddingsNextN(true, true)
	if len(ctxToks) == 0 {
		return tgt, d
	}
	tgt.BatchClear()
	for i, tok := range ctxToks {
		if _, err := tgt.BatchAdd(tok, i, 0, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := tgt.Decode(); err != nil {
		t.Fatal(err)
	}
	return tgt, d
}

// mtpTestTokens is n tokens of the test vocabulary, a different run for each seed.
func mtpTestTokens(seed, n int) []engine.Token {
	out := make([]engine.Token, n)
	for i := range out {
		out[i] = engine.Token(4 + (seed+i*37+i*i)%120)
	}
	return out
}

// draftsByTask is m's proposals for wants, by task.
func draftsByTask(m *MTP, wants []engine.DraftWant) map[engine.TaskID][]engine.Token {
	got := map[engine.TaskID][]engine.Token{}
	for _, p := range m.Draft(wants) {
		got[p.Task] = p.Tokens
	}
	return got
}

// TestMTPChainedDraftsMatchReference: a model with two MTP blocks (mimo2mtp, MiMo-V2's
// layout) drafts through both in turn, each block in a context of its own mirroring the
// target (MTP.ChainHeads). After a pool copy into two sessions, their own suffixes and a
// verify batch cut back by a rejected draft, the drafts equal what fresh contexts give
// when each block is fed the whole context at once and the chain is run from there: so
// the second block's cells and the rows each step reads are the right ones.
func TestMTPChainedDraftsMatchReference(t *testing.T) {
	llama.Init()
	m, err := llama.LoadModelWith(testmodel.Arch(t, "mimo2mtp"), llama.ModelParams{LoadMTP: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	if m.NLayerNextN() != 2 {
		t.Fatalf("%d NextN blocks, want 2", m.NLayerNextN())
	}
	const k = 2 // one draft per block
	// Every position stays within the 32-token window: no sequence here has SWA shadows.
	p := llama.ContextParams{NCtx: 256, NBatch: 64, NUBatch: 64, NSeqMax: 4, NThreads: 2, KVUnified: true, SWAFull: true}
	tgt, h0 := refContexts(t, m, m, p, nil)
	h1 := chainHead(t, m, tgt, p, 1)
	mtp, err := NewMTP(m, tgt, h0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := mtp.ChainHeads(h1); err != nil {
		t.Fatal(err)
	}
	mtp.CheckMirror(4)
	b := NewBackend(m, tgt, nil)
	b.EnableDrafter(mtp)
	check := func(name string, got []engine.Token, ctxToks []engine.Token) {
		t.Helper()
		if want := mtpChainReference(t, m, p, ctxToks, k); !slices.Equal(got, want) {
			t.Errorf("%s: chained drafts %v, fresh contexts over the same context %v", name, got, want)
		}
		t.Logf("%s: drafted %v", name, got)
	}

	_, s0, s1 := poolSessions(t, b, 12)
	w0 := append(slices.Clone(s0), 44)
	w1 := append(slices.Clone(s1), 17)
	got := draftsByTask(mtp, []engine.DraftWant{{Task: 1, Seq: 0, Tokens: w0, K: k}, {Task: 2, Seq: 1, Tokens: w1, K: 5}})
	check("session 0 on the pool", got[1], w0)
	check("session 1 on the pool (asked for 5)", got[2], w1)
	if len(got[1]) != k || len(got[2]) != k {
		t.Fatalf("drafted %d and %d tokens, want %d each: one per block (p-min 0)", len(got[1]), len(got[2]), k)
	}
	// Verify session 0's drafts; the second is rejected.
	decodeAt(t, b, 0, len(s0), append([]engine.Token{44}, got[1]...)...)
	if !b.SeqRm(0, len(s0)+2, -1) {
		t.Fatal("rollback of the rejected draft refused")
	}
	w0 = append(append(slices.Clone(s0), 44, got[1][0]), 9)
	got = draftsByTask(mtp, []engine.DraftWant{{Task: 1, Seq: 0, Tokens: w0, K: k}})
	check("session 0 after a rejected draft", got[1], w0)
	if n, first := mtp.Mismatches(); n > 0 {
		t.Errorf("the MTP contexts' cells left the target's %d times; first %s", n, first)
	}
	if g := mtp.Gaps(); g > 0 {
		t.Errorf("%d entries mirrored without their hidden state", g)
	}
}

// chainHead is an MTP context over tgt on m running NextN block i, freed when the test ends.
func chainHead(t *testing.T, m *llama.Model, tgt *llama.Context, p llama.ContextParams, i int) *llama.Context {
	t.Helper()
	p.MTPTarget = tgt
	c, err := llama.NewContext(m, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Free)
	if err := c.SetNextNLayer(i); err != nil {
		t.Fatal(err)
	}
	c.SetEmbeddingsNextN(true, true)
	return c
}

// mtpChainReference drafts k tokens after toks (context and next token) through every
// NextN block of m in turn, from scratch: a fresh target decodes the context in one
// batch; a fresh context per block is fed each context token with the target's row of
// the position before; then block i reads the next token and drafts 1..i at their
// positions with their rows (the target's, then each earlier block's) and gives draft i+1.
func mtpChainReference(t *testing.T, m *llama.Model, p llama.ContextParams, toks []engine.Token, k int) []engine.Token {
	t.Helper()
	n := len(toks) - 1
	p.NSeqMax = 1
	tgt, h0 := refContexts(t, m, m, p, toks[:n])
	heads := []*llama.Context{h0}
	for i := 1; i < m.NLayerNextN(); i++ {
		heads = append(heads, chainHead(t, m, tgt, p, i))
	}
	zero := make([]float32, m.NEmbdOut())
	for _, c := range heads {
		c.BatchClear()
		for i, tok := range toks[:n] {
			h := zero
			if i > 0 {
				h = tgt.EmbeddingsNextN(i - 1)
			}
			if _, err := c.BatchAddEmbd(tok, i, 0, false, h); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Decode(); err != nil {
			t.Fatal(err)
		}
	}
	rows := [][]float32{tgt.EmbeddingsNextN(n - 1)}
	var out []engine.Token
	for _, c := range heads[:min(k, len(heads))] {
		c.BatchClear()
		last := 0
		for j := 0; j <= len(out); j++ {
			tok := toks[n]
			if j > 0 {
				tok = out[j-1]
			}
			i, err := c.BatchAddEmbd(tok, n+j, 0, true, rows[j])
			if err != nil {
				t.Fatal(err)
			}
			last = i
		}
		if err := c.Decode(); err != nil {
			t.Fatal(err)
		}
		tok, _, ok := c.Greedy(last, m.NVocab())
		if !ok {
			t.Fatal("no logits for the draft row")
		}
		out = append(out, tok)
		rows = append(rows, c.EmbeddingsNextN(last))
	}
	return out
}

// poolSessions prefills a pool of n tokens in sequence 2, copies it into sequences 0 and
// 1, and decodes their own suffixes (6 and 4 tokens) there: the pool's tokens and the
// two sessions' contexts.
func poolSessions(t *testing.T, b *Backend, n int) (pool, s0, s1 []engine.Token) {
	t.Helper()
	pool = mtpTestTokens(1, n)
	decodeAt(t, b, 2, 0, pool...)
	s0 = append(slices.Clone(pool), mtpTestTokens(2, 6)...)
	s1 = append(slices.Clone(pool), mtpTestTokens(3, 4)...)
	b.SeqCp(2, 0, 0, n)
	b.SeqCp(2, 1, 0, n)
	decodeAt(t, b, 0, n, s0[n:]...)
	decodeAt(t, b, 1, n, s1[n:]...)
	return pool, s0, s1
}
