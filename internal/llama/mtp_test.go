package llama

import (
	"math"
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// mtpPrompt is a fixed prompt inside the 128-token vocabulary of the MTP test model.
func mtpPrompt(n int) []Token {
	out := make([]Token, n)
	for i := range out {
		out[i] = Token(4 + (i*37)%120)
	}
	return out
}

func argmax(v []float32) Token {
	best := 0
	for i := range v {
		if v[i] > v[best] {
			best = i
		}
	}
	return Token(best)
}

func allFinite(t *testing.T, what string, v []float32, n int) {
	t.Helper()
	if len(v) != n {
		t.Fatalf("%s: %d values, want %d", what, len(v), n)
	}
	for i, x := range v {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			t.Fatalf("%s[%d] = %v", what, i, x)
		}
	}
}

// mtpContextParams is a one-sequence context on the tiny model.
func mtpContextParams() ContextParams {
	return ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true}
}

// decodeAll decodes toks at positions from pos0 in sequence 0, logits for the last only.
func decodeAll(t *testing.T, c *Context, toks []Token, pos0 int) {
	t.Helper()
	c.BatchClear()
	for i, tok := range toks {
		if _, err := c.BatchAdd(tok, pos0+i, 0, i == len(toks)-1); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Decode(); err != nil {
		t.Fatal(err)
	}
}

// TestMTPContext loads the MTP test models (scripts/qwen35mtp-testmodel.cpp: a hybrid
// qwen35 trunk of 2 layers and one NextN block; scripts/glm4moemtp-testmodel.cpp: the
// same on an attention-only glm4moe trunk) and checks what a draft-mtp driver needs
// from the binding: the NextN layer is counted (and not in NLayer) whether loaded or not;
// an MTP context is refused without LoadMTP; with it the trunk's logits are bit for bit
// those of the plain load, and with unmasked NextN rows on within tol (0 on qwen35:
// glm4moe's graph then runs its last FFN over every row, which rounds differently); the
// target gives a finite NextN row for every batch entry (unmasked); an MTP context on
// the same model decodes the prompt paired with those rows (its KV then holds every
// position) and a draft step with finite logits and NextN row; and SeqRm of the draft
// position on the MTP context lets the same step be redone with identical logits (how a
// driver drops rejected drafts).
func TestMTPContext(t *testing.T) {
	for _, c := range []struct {
		model string
		tol   float64
	}{{"qwen35mtp", 0}, {"glm4moemtp", 1e-5}} {
		t.Run(c.model, func(t *testing.T) { testMTPContext(t, c.model, c.tol) })
	}
}

func testMTPContext(t *testing.T, model string, tol float64) {
	path := testmodel.Arch(t, model)
	plain, err := LoadModel(path)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Free()
	if plain.NLayerNextN() != 1 || plain.NLayer() != 2 || plain.MTPLoaded() {
		t.Fatalf("plain load: %d NextN layers, %d layers, MTP loaded %v; want 1, 2, false", plain.NLayerNextN(), plain.NLayer(), plain.MTPLoaded())
	}
	prompt := mtpPrompt(40)
	pc, err := NewContext(plain, mtpContextParams())
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Free()
	if _, err := NewContext(plain, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, MTPTarget: pc}); err == nil {
		t.Fatal("an MTP context on a model loaded without LoadMTP was accepted")
	}
	decodeAll(t, pc, prompt, 0)
	want := pc.Logits(len(prompt) - 1)

	m, err := LoadModelWith(path, ModelParams{LoadMTP: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	if m.NLayerNextN() != 1 || m.NLayer() != 2 || !m.MTPLoaded() {
		t.Fatalf("MTP load: %d NextN layers, %d layers, MTP loaded %v; want 1, 2, true", m.NLayerNextN(), m.NLayer(), m.MTPLoaded())
	}
	tgt, err := NewContext(m, mtpContextParams())
	if err != nil {
		t.Fatal(err)
	}
	defer tgt.Free()
	if tgt.IsMTP() {
		t.Fatal("the target context says it is an MTP context")
	}
	if _, err := NewContext(plain, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, MTPTarget: tgt}); err == nil {
		t.Fatal("an MTP context on another model than its target's was accepted")
	}
	decodeAll(t, tgt, prompt, 0)
	if got := tgt.Logits(len(prompt) - 1); !slices.Equal(got, want) {
		t.Fatal("the trunk's logits differ when the MTP layers are loaded")
	}
	tgt.SeqRm(0, -1, -1)
	tgt.SetEmbeddingsNextN(true, false)
	decodeAll(t, tgt, prompt, 0)
	d0 := 0.0
	for i, x := range tgt.Logits(len(prompt) - 1) {
		d0 = max(d0, math.Abs(float64(x-want[i])))
	}
	if d0 > tol {
		t.Fatalf("the trunk's logits move by %g with the NextN rows on, want at most %g", d0, tol)
	}
	t.Logf("trunk logits with NextN rows on: largest difference %g", d0)
	n := m.NEmbdOut()
	h := make([][]float32, len(prompt))
	for i := range prompt {
		h[i] = tgt.EmbeddingsNextN(i)
		allFinite(t, "target NextN row", h[i], n)
	}

	d, err := NewContext(m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, MTPTarget: tgt})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free()
	if !d.IsMTP() {
		t.Fatal("the MTP context does not say so")
	}
	if _, err := d.BatchAddEmbd(prompt[0], 0, 0, false, make([]float32, n-1)); err == nil {
		t.Fatal("a short embedding row was accepted")
	}
	if _, err := tgt.BatchAddEmbd(prompt[0], 0, 0, false, make([]float32, n)); err == nil {
		t.Fatal("BatchAddEmbd on a target context was accepted")
	}
	d.SetEmbeddingsNextN(true, true)
	// The catch-up: token p with the target's h of p-1 (zeros before the first).
	d.BatchClear()
	for i, tok := range prompt {
		hp := make([]float32, n)
		if i > 0 {
			hp = h[i-1]
		}
		if _, err := d.BatchAddEmbd(tok, i, 0, false, hp); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Decode(); err != nil {
		t.Fatal(err)
	}
	if got := d.SeqPosMax(0); got != len(prompt)-1 {
		t.Fatalf("the MTP context holds positions up to %d, want %d", got, len(prompt)-1)
	}
	// One draft step: the token the target predicts next, at the next position, with h of
	// the last prompt token.
	next := argmax(want)
	draft := func() ([]float32, []float32) {
		d.BatchClear()
		i, err := d.BatchAddEmbd(next, len(prompt), 0, true, h[len(prompt)-1])
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		return d.Logits(i), d.EmbeddingsNextN(i)
	}
	l1, h1 := draft()
	allFinite(t, "draft logits", l1, m.NVocab())
	allFinite(t, "draft NextN row", h1, n)
	if !d.SeqRm(0, len(prompt), -1) {
		t.Fatal("SeqRm of the draft position on the MTP context failed")
	}
	l2, h2 := draft()
	if !slices.Equal(l1, l2) || !slices.Equal(h1, h2) {
		t.Fatal("the draft step after SeqRm gives other logits or NextN row")
	}
	t.Logf("draft after %d prompt tokens: target next %d, MTP draft %d", len(prompt), next, argmax(l1))
}

// TestMTPGreedyLossless drives MTP drafting by hand through the binding, one drafted
// token per step, the way llama.cpp's draft-mtp does (draft on the MTP context, verify on
// the target, catch the MTP context up with the target's NextN rows, drop rejected
// positions from both), on the hybrid MTP test model: its recurrent layer's state is
// rolled back through n_rs_seq (RSSeq 1) when a draft is rejected. The greedy tokens must
// equal one-token-at-a-time greedy decoding, and the prompt is one where drafts are both
// accepted and rejected, so that both paths run.
func TestMTPGreedyLossless(t *testing.T) {
	path := testmodel.Arch(t, "qwen35mtp")
	m, err := LoadModelWith(path, ModelParams{LoadMTP: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	prompt := mtpPrompt(16)
	const nGen = 32

	// Reference: plain greedy, one token per decode.
	ref, err := NewContext(m, mtpContextParams())
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Free()
	decodeAll(t, ref, prompt, 0)
	var want []Token
	tok := argmax(ref.Logits(len(prompt) - 1))
	for len(want) < nGen {
		want = append(want, tok)
		decodeAll(t, ref, []Token{tok}, len(prompt)+len(want)-1)
		tok = argmax(ref.Logits(0))
	}

	p := mtpContextParams()
	p.RSSeq = 1
	tgt, err := NewContext(m, p)
	if err != nil {
		t.Fatal(err)
	}
	defer tgt.Free()
	tgt.SetEmbeddingsNextN(true, false)
	d, err := NewContext(m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, MTPTarget: tgt})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free()
	d.SetEmbeddingsNextN(true, true)
	n := m.NEmbdOut()

	// Prefill both: the target, then the MTP context with the target's rows shifted by one.
	decodeAll(t, tgt, prompt, 0)
	d.BatchClear()
	pending := make([]float32, n)
	for i, tk := range prompt {
		if _, err := d.BatchAddEmbd(tk, i, 0, false, pending); err != nil {
			t.Fatal(err)
		}
		pending = tgt.EmbeddingsNextN(i)
	}
	if err := d.Decode(); err != nil {
		t.Fatal(err)
	}
	last := argmax(tgt.Logits(len(prompt) - 1)) // sampled, not yet decoded
	pos := len(prompt)                          // its position
	var got []Token
	accepted, rejected := 0, 0
	for len(got) < nGen {
		cur := last
		// Draft one token: cur at pos with the NextN row of pos-1.
		d.BatchClear()
		i, err := d.BatchAddEmbd(cur, pos, 0, true, pending)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		draft := argmax(d.Logits(i))
		if !d.SeqRm(0, pos, -1) { // the catch-up below decodes pos again with the target's row
			t.Fatal("SeqRm of the draft position failed")
		}
		// Verify [cur, draft] on the target.
		tgt.BatchClear()
		if _, err := tgt.BatchAdd(cur, pos, 0, true); err != nil {
			t.Fatal(err)
		}
		if _, err := tgt.BatchAdd(draft, pos+1, 0, true); err != nil {
			t.Fatal(err)
		}
		if err := tgt.Decode(); err != nil {
			t.Fatal(err)
		}
		h0, h1 := tgt.EmbeddingsNextN(0), tgt.EmbeddingsNextN(1)
		t0 := argmax(tgt.Logits(0))
		nAcc := 0
		got = append(got, cur)
		if t0 == draft {
			nAcc = 1
			accepted++
			got = append(got, draft)
			last = argmax(tgt.Logits(1))
		} else {
			rejected++
			last = t0
			if !tgt.SeqRm(0, pos+1, -1) {
				t.Fatal("the target could not drop the rejected draft (recurrent rollback, n_rs_seq 1)")
			}
		}
		// Catch the MTP context up with the verified batch: cur with the row of pos-1,
		// draft with the target's row of pos; then keep the row of the last accepted one.
		d.BatchClear()
		if _, err := d.BatchAddEmbd(cur, pos, 0, false, pending); err != nil {
			t.Fatal(err)
		}
		if _, err := d.BatchAddEmbd(draft, pos+1, 0, false, h0); err != nil {
			t.Fatal(err)
		}
		if err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		if nAcc == 0 {
			pending = h0
			if !d.SeqRm(0, pos+1, -1) {
				t.Fatal("SeqRm of the rejected position on the MTP context failed")
			}
		} else {
			pending = h1
		}
		pos += 1 + nAcc
	}
	got = got[:nGen]
	if !slices.Equal(got, want) {
		t.Fatalf("greedy with MTP drafts differs from plain greedy:\n got  %v\n want %v", got, want)
	}
	if accepted == 0 || rejected == 0 {
		t.Fatalf("drafts accepted %d, rejected %d: the prompt no longer runs both paths", accepted, rejected)
	}
	t.Logf("%d tokens, %d drafts accepted, %d rejected", nGen, accepted, rejected)
}
