package runner

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// The top-n list must be exactly the n largest entries of a full log-softmax, sorted,
// ties by token id, and the sampled token's logprob must be its own entry.
func TestLogprobsTopNMatchesFullSort(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 50; trial++ {
		v := 1 + r.IntN(3000)
		logits := make([]float32, v)
		for i := range logits {
			logits[i] = float32(r.NormFloat64() * 4)
			if r.IntN(10) == 0 && i > 0 {
				logits[i] = logits[i-1] // ties
			}
		}
		// reference: full log-softmax in float64, sorted
		mx := math.Inf(-1)
		for _, l := range logits {
			mx = math.Max(mx, float64(l))
		}
		var sum float64
		for _, l := range logits {
			sum += math.Exp(float64(l) - mx)
		}
		ids := make([]int, v)
		for i := range ids {
			ids[i] = i
		}
		sort.SliceStable(ids, func(a, b int) bool { return logits[ids[a]] > logits[ids[b]] })
		n := r.IntN(21)
		tok := int32(r.IntN(v))
		lp, top := logprobs(logits, tok, n)
		want := float64(logits[tok]) - mx - math.Log(sum)
		if math.Abs(float64(lp)-want) > 1e-4 {
			t.Fatalf("logprob %g, want %g", lp, want)
		}
		if len(top) != min(n, v) {
			t.Fatalf("got %d alternatives, want %d", len(top), min(n, v))
		}
		var mass float64
		for i, e := range top {
			if int(e.Token) != ids[i] {
				t.Fatalf("trial %d: top[%d] is token %d, want %d", trial, i, e.Token, ids[i])
			}
			w := float64(logits[ids[i]]) - mx - math.Log(sum)
			if math.Abs(float64(e.Logprob)-w) > 1e-4 {
				t.Fatalf("top[%d] logprob %g, want %g", i, e.Logprob, w)
			}
			mass += math.Exp(float64(e.Logprob))
		}
		if mass > 1+1e-4 {
			t.Fatalf("alternatives carry probability %g > 1", mass)
		}
	}
	if lp, top := logprobs([]float32{1, 2}, 1, 0); top != nil || lp >= 0 {
		t.Fatalf("n=0: %g %v", lp, top)
	}
}

// BenchmarkLogprobs measures the per-token cost of logprobs with and without the top-N
// alternatives over SmolLM2's vocabulary size (49,152).
func BenchmarkLogprobs(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	logits := make([]float32, 49152)
	for i := range logits {
		logits[i] = float32(r.NormFloat64() * 4)
	}
	for _, n := range []int{0, 5, 20} {
		b.Run(fmt.Sprintf("top%d", n), func(b *testing.B) {
			for b.Loop() {
				logprobs(logits, 7, n)
			}
		})
	}
}
