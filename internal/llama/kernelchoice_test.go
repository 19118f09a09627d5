package llama

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

// kernelChoice is one (flash-attention, matrix) kernel pair.
type kernelChoice struct{ attn, mm Kernel }

func (k kernelChoice) String() string {
	name := func(x Kernel) string {
		if x == KernelGGML {
			return "ggml"
		}
		return "polykv"
	}
	return fmt.Sprintf("attention %s, matrix %s", name(k.attn), name(k.mm))
}

// kernelStepper prefills prompt as sequence 0 of c in one batch, then decodes the tokens
// of then one at a time, a step per call; logits holds the last prompt token's and each
// decoded token's.
type kernelStepper struct {
	c            *Context
	prompt, then []Token
	step         int
	logits       [][]float32
}

func (s *kernelStepper) next(t *testing.T) {
	t.Helper()
	toks, from := s.prompt, 0
	if s.step > 0 {
		toks, from = s.then[s.step-1:s.step], len(s.prompt)+s.step-1
	}
	s.c.BatchClear()
	idx := -1
	for i, tok := range toks {
		j, err := s.c.BatchAdd(tok, from+i, 0, i == len(toks)-1)
		if err != nil {
			t.Error(err)
			return
		}
		idx = j
	}
	if err := s.c.Decode(); err != nil {
		t.Error(err)
		return
	}
	s.logits = append(s.logits, s.c.Logits(idx))
	s.step++
}

func (s *kernelStepper) done() bool { return s.step > len(s.then) }

// kernelContext is a context for kernelStepper with the given attention kernel.
func kernelContext(t *testing.T, m *Model, attn Kernel) *Context {
	t.Helper()
	c, err := NewContext(m, ContextParams{NCtx: 512, NBatch: 128, NSeqMax: 1, NThreads: 1, KVUnified: true, FlashAttn: 1,
		SWAFull: m.NSWA() > 0, AttnKernel: attn})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestKernelChoicePerContext checks that the kernel choice belongs to a context
// (attention) and to a model (matrix products), not to the process (which has none):
// contexts with different choices alive in one process, beside another model and
// context whose choices are set against them, each give the logits, bit for bit, of a
// run where that choice was the only one; decoded in turn, PolyKV's kernels run for
// exactly the contexts and models that chose them; decoded at the same time on two
// goroutines, the outputs stay the same.
func TestKernelChoicePerContext(t *testing.T) {
	forEachFamily(t, func(t *testing.T, m *Model) {
		if !MatMulKernelAvailable() {
			t.Skip("this build has no AVX2/FMA: PolyKV's kernels are not compiled in")
		}
		prompt, then := fattnPrompt(t, m)
		prompt = prompt[:100] // short: what matters is which kernel ran, not the context length
		choices := []kernelChoice{{KernelPolyKV, KernelPolyKV}, {KernelGGML, KernelGGML}, {KernelGGML, KernelPolyKV}}

		// The references: each choice alone, on the loaded model.
		want := map[kernelChoice][][]float32{}
		for _, k := range choices {
			setMatMulKernel(t, m, k.mm)
			c := kernelContext(t, m, k.attn)
			s := &kernelStepper{c: c, prompt: prompt, then: then}
			for !s.done() {
				s.next(t)
			}
			c.Free()
			want[k] = s.logits
		}
		for i, a := range choices {
			for _, b := range choices[i+1:] {
				if logitsEqual(want[a], want[b]) {
					t.Fatalf("%v and %v give the same logits: this test could not tell which kernel ran", a, b)
				}
			}
		}

		// One model per matrix kernel (loaded again from the same file: weights are
		// shared by a model's contexts, so the matrix choice is the model's).
		models := map[Kernel]*Model{}
		for _, mm := range []Kernel{KernelPolyKV, KernelGGML} {
			mk, err := LoadModelWith(m.Path(), ModelParams{MatMulKernel: mm})
			if err != nil {
				t.Fatal(err)
			}
			defer mk.Free()
			models[mm] = mk
		}
		// A bystander: the first model, its choice and a context of its own set to one
		// kernel, then the other, while the three contexts above keep theirs.
		for _, other := range []Kernel{KernelGGML, KernelPolyKV} {
			setMatMulKernel(t, m, other)
			all := append(slices.Clone(choices), kernelChoice{other, other})
			var steppers []*kernelStepper
			for i, k := range all {
				mk := m
				if i < len(choices) {
					mk = models[k.mm]
				}
				c := kernelContext(t, mk, k.attn)
				defer c.Free()
				steppers = append(steppers, &kernelStepper{c: c, prompt: prompt, then: then})
			}
			// In turn: each context's steps between the others', counting the kernels' runs.
			for !steppers[0].done() {
				for i, s := range steppers {
					fa, mm := FlashAttnKernelRuns(), MatMulKernelRuns()
					s.next(t)
					ranFA, ranMM := FlashAttnKernelRuns() != fa, MatMulKernelRuns() != mm
					if k := all[i]; ranFA != (k.attn == KernelPolyKV) || ranMM != (k.mm == KernelPolyKV) {
						t.Errorf("bystander %v, %v, step %d: PolyKV's attention kernel ran: %v, its matrix kernel: %v",
							other, k, s.step-1, ranFA, ranMM)
					}
				}
			}
			for i, s := range steppers {
				if !logitsEqual(s.logits, want[all[i]]) {
					t.Errorf("bystander %v, %v, decoded in turn with the others: logits differ from that choice alone", other, all[i])
				}
			}
		}

		// At the same time: the two contexts of the PolyKV model, one per attention kernel.
		var wg sync.WaitGroup
		got := make([][][]float32, 2)
		for i, k := range []kernelChoice{choices[0], choices[2]} {
			c := kernelContext(t, models[k.mm], k.attn)
			defer c.Free()
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := &kernelStepper{c: c, prompt: prompt, then: then}
				for !s.done() {
					s.next(t)
				}
				got[i] = s.logits
			}()
		}
		wg.Wait()
		for i, k := range []kernelChoice{choices[0], choices[2]} {
			if !logitsEqual(got[i], want[k]) {
				t.Errorf("%v, decoded at the same time as another context: logits differ from that choice alone", k)
			}
		}
	})
}

// logitsEqual reports whether two runs' logits are the same bits (NaN never is).
func logitsEqual(a, b [][]float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if len(a[i]) != len(b[i]) || maxDiff(a[i], b[i]) != 0 {
			return false
		}
	}
	return true
}
