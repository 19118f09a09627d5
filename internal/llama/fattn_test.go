package llama

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// fattnRun prefills prompt into sequence 0 in chunks of chunk tokens (after a neighbour
// sequence of neighbour tokens took the first cells) and decodes greedily for steps
// tokens; it returns the logits of the last prompt token and of each decoded token.
func fattnRun(t *testing.T, m *Model, prompt []Token, chunk, neighbour, steps int) [][]float32 {
	return fattnRunFA(t, m, prompt, chunk, neighbour, steps, 1)
}

func fattnRunFA(t *testing.T, m *Model, prompt []Token, chunk, neighbour, steps, fa int) [][]float32 {
	t.Helper()
	c, err := NewContext(m, ContextParams{NCtx: 1024, NBatch: 256, NSeqMax: 2, NThreads: 2, KVUnified: true, FlashAttn: fa, SWAFull: m.NSWA() > 0})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free()
	decode := func(seq int, toks []Token, from int, last bool) int {
		c.BatchClear()
		idx := -1
		for i, tok := range toks {
			j, err := c.BatchAdd(tok, from+i, seq, last && i == len(toks)-1)
			if err != nil {
				t.Fatal(err)
			}
			idx = j
		}
		if err := c.Decode(); err != nil {
			t.Fatal(err)
		}
		return idx
	}
	for i := 0; i < neighbour; i += 64 {
		n := min(64, neighbour-i)
		decode(1, slices.Repeat([]Token{Token(200 + i%50)}, n), i, false)
	}
	var out [][]float32
	var idx int
	for i := 0; i < len(prompt); i += chunk {
		end := min(i+chunk, len(prompt))
		idx = decode(0, prompt[i:end], i, end == len(prompt))
	}
	out = append(out, c.Logits(idx))
	for s := range steps {
		next := Token(argmax(out[len(out)-1]))
		out = append(out, c.Logits(decode(0, []Token{next}, len(prompt)+s, true)))
	}
	return out
}

func argmax(v []float32) int {
	best := 0
	for i, x := range v {
		if x > v[best] {
			best = i
		}
	}
	return best
}

// TestFlashAttnKernel checks PolyKV's flash-attention kernel (fattn.cpp) on both model
// families: it runs (and ggml's kernel runs when chosen); a token's logits are the same
// bit for bit whether its prompt is prefilled in one batch, 7 tokens at a time or one at a
// time, and wherever another sequence put its cells first (what keeps pooled == unpooled
// greedy output); and they are as close to plain attention as ggml's flash kernel's are,
// and pick the same next token.
func TestFlashAttnKernel(t *testing.T) {
	for _, fam := range []struct {
		name string
		path func(testing.TB) string
	}{{"smollm2", testmodel.SmolLM2}, {"gemma3", testmodel.Gemma}} {
		t.Run(fam.name, func(t *testing.T) {
			m, err := LoadModel(fam.path(t))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Free()
			prompt, err := m.Tokenize(strings.Repeat("Agents share one long system prompt and then ask their own questions. ", 40), true, false)
			if err != nil {
				t.Fatal(err)
			}
			prompt = prompt[:600] // past Gemma 3's 512-cell sliding window
			defer SetFlashAttnKernel(true)

			SetFlashAttnKernel(true)
			before := FlashAttnKernelRuns()
			whole := fattnRun(t, m, prompt, 256, 0, 4)
			if FlashAttnKernelRuns() == before {
				t.Skip("PolyKV's flash-attention kernel is not available here (needs AVX2 and FMA)")
			}
			for _, v := range []struct {
				name             string
				chunk, neighbour int
			}{{"7 tokens at a time", 7, 0}, {"one token at a time", 1, 0}, {"after a 100-cell neighbour", 256, 100}, {"after a neighbour, 7 at a time", 7, 37}} {
				got := fattnRun(t, m, prompt, v.chunk, v.neighbour, 4)
				for i := range whole {
					if d := maxDiff(got[i], whole[i]); d != 0 {
						t.Errorf("%s: logits of step %d differ from the one-batch prefill by up to %g", v.name, i, d)
					}
				}
			}

			SetFlashAttnKernel(false)
			before = FlashAttnKernelRuns()
			stock := fattnRun(t, m, prompt, 256, 0, 4)
			if FlashAttnKernelRuns() != before {
				t.Fatal("PolyKV's kernel ran while ggml's was chosen")
			}
			// No kernel is exact: the reference is how far ggml's flash kernel itself is from
			// plain attention (mul_mat and softmax, --flash-attn off) on the same prompt;
			// over ~50k-260k logits after 18-30 layers that is a logit or more.
			plain := fattnRunFA(t, m, prompt, 256, 0, 4, 0)
			ours, theirs := 0.0, 0.0
			for i := range whole {
				ours = max(ours, maxDiff(whole[i], plain[i]))
				theirs = max(theirs, maxDiff(stock[i], plain[i]))
			}
			t.Logf("largest logit difference to plain attention over %d steps: PolyKV's kernel %.3f, ggml's %.3f", len(whole), ours, theirs)
			if ours > 1.5*theirs || math.IsNaN(ours) {
				t.Errorf("PolyKV's kernel is %.3f from plain attention, ggml's flash kernel %.3f", ours, theirs)
			}
			if a, b := argmax(whole[0]), argmax(stock[0]); a != b {
				t.Errorf("next token after the prompt: %d with PolyKV's kernel, %d with ggml's", a, b)
			}
		})
	}
}

func maxDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		panic(fmt.Sprintf("logit rows of %d and %d", len(a), len(b)))
	}
	d := 0.0
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}
