package llama

import (
	"math"
	"testing"

	"golang.org/x/sys/cpu"
)

// TestKQuantKernel checks PolyKV's matrix kernel (Q4_K, Q6_K, Q4_1) on random matrices,
// without a model: the product of every activation row is the same bits whether the
// rows are computed all at once (packed tiles; also with the packing budget cut to one
// block, as a vocabulary-sized matrix is packed), one at a time or three at a time (the
// direct decode path), which is what keeps a token's logits independent of its batch,
// and agrees with ggml's vec_dot to float rounding. Shapes include a weight-row count
// that is not a multiple of the 8-row block, a K that is not a multiple of 256 (Q4_1),
// and more activation rows than one 64-row chunk.
func TestKQuantKernel(t *testing.T) {
	if !MatMulKernelAvailable() {
		t.Skip("this build has no AVX2/FMA: PolyKV's matrix kernel is not compiled in")
	}
	// The run-time choice: VNNI exactly where the CPU has it (and its 256-bit form).
	vnni := cpu.X86.HasAVX512VNNI && cpu.X86.HasAVX512VL
	if MatMulKernelVNNI() != vnni {
		t.Errorf("VNNI path in use %v, CPU has AVX-512 VNNI+VL %v", MatMulKernelVNNI(), vnni)
	}
	// Where the CPU has VNNI, the self-test also runs the AVX2 path and compares the
	// bits: that is the path every x86-64-v3 CPU without AVX-512 takes.
	wantPaths := 1
	if vnni {
		wantPaths = 2
	}
	for _, tc := range []struct {
		name    string
		typ     int
		m, k, n int
	}{
		{"q4_K", ggmlTypeQ4K, 37, 512, 11},
		{"q4_K", ggmlTypeQ4K, 64, 1024, 70},
		{"q6_K", ggmlTypeQ6K, 37, 512, 11},
		{"q6_K", ggmlTypeQ6K, 64, 2048, 70},
		{"q4_1", ggmlTypeQ41, 37, 576, 11},
		{"q4_1", ggmlTypeQ41, 64, 1536, 70},
	} {
		rel, same, paths, err := kquantSelfTest(tc.typ, tc.m, tc.k, tc.n, 7)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s %dx%d, %d rows: largest difference from ggml %.2g (relative), batch-invariant %v on %d instruction path(s)", tc.name, tc.m, tc.k, tc.n, rel, same, paths)
		if !same {
			t.Errorf("%s %dx%d: rows computed together differ from rows computed alone", tc.name, tc.m, tc.k)
		}
		if paths != wantPaths {
			t.Errorf("%s %dx%d: %d instruction path(s) compared, want %d", tc.name, tc.m, tc.k, paths, wantPaths)
		}
		if rel > 1e-5 {
			t.Errorf("%s %dx%d: differs from ggml's vec_dot by %.3g of the largest result", tc.name, tc.m, tc.k, rel)
		}
	}
}

// TestKQuantKernelModel runs both model families with PolyKV's matrix kernel and with
// ggml's: SmolLM2 (Q4_1 weights) and Gemma 3 270M (Q4_K_M: its attention-output and
// FFN-down weights are Q4_K and Q6_K). The kernel computes products in the first run and
// none in the second, a token's logits are the same bits whether the prompt is
// prefilled 256 or 13 tokens at a time, and the two kernels' next-token distributions
// agree to float rounding (both compute the same integer dot products; only the order
// of the float scaling differs). Where the CPU has AVX-512 VNNI, the AVX2 path (what
// CPUs without it run) must give the same bits. The exact check against ggml's vec_dot
// is TestKQuantKernel's.
func TestKQuantKernelModel(t *testing.T) {
	forEachFamily(t, func(t *testing.T, m *Model) {
		if !MatMulKernelAvailable() {
			t.Skip("this build has no AVX2/FMA: PolyKV's matrix kernel is not compiled in")
		}
		prompt, then := fattnPrompt(t, m)

		before := MatMulKernelRuns()
		ours := fattnRun(t, m, prompt, 256, 0, then)
		if MatMulKernelRuns() == before {
			t.Fatal("PolyKV's matrix kernel computed nothing")
		}
		chunked := fattnRun(t, m, prompt, 13, 37, then)
		for i := range ours {
			if d := maxDiff(chunked[i], ours[i]); d != 0 {
				t.Errorf("logits of step %d differ by up to %g between 256- and 13-token prefill chunks", i, d)
			}
		}
		// The plain AVX2 path (a CPU without AVX-512 VNNI) gives the same bits on the
		// whole model, not only on TestKQuantKernel's random matrices.
		if MatMulKernelVNNI() {
			setMatMulKernel(t, m, kernelPolyKVAVX2)
			avx2 := fattnRun(t, m, prompt, 13, 37, then)
			setMatMulKernel(t, m, KernelPolyKV)
			for i := range ours {
				if d := maxDiff(avx2[i], ours[i]); d != 0 {
					t.Errorf("logits of step %d differ by up to %g between the VNNI and AVX2 paths", i, d)
				}
			}
		} else {
			t.Log("this CPU has no AVX-512 VNNI: the run above was the AVX2 path")
		}

		setMatMulKernel(t, m, KernelGGML)
		before = MatMulKernelRuns()
		stock := fattnRun(t, m, prompt, 256, 0, then)
		if MatMulKernelRuns() != before {
			t.Fatal("PolyKV's matrix kernel ran while ggml's was chosen")
		}
		worst := 0.0
		for i := range ours {
			worst = max(worst, kl(stock[i], ours[i]))
		}
		t.Logf("largest KL divergence of the next-token distribution from ggml's kernel over %d steps: %.2g nats", len(ours), worst)
		// Rounding-level differences grow through the layers on this prompt to about
		// 0.01 nats (ggml's own two flash-attention kernels differ by as much, see
		// TestFlashAttnKernel); a wrong scale or min term costs nats.
		if worst > 0.05 || math.IsNaN(worst) {
			t.Errorf("PolyKV's matrix kernel is %.3g nats from ggml's", worst)
		}
	})
}

// setMatMulKernel sets m's matrix kernel or fails the test.
func setMatMulKernel(t *testing.T, m *Model, k Kernel) {
	t.Helper()
	if err := m.SetMatMulKernel(k); err != nil {
		t.Fatal(err)
	}
}
