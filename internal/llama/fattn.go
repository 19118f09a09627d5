package llama

/*
#include "fattn.h"
*/
import "C"

import "sync/atomic"

// stockFlashAttn is the process-wide kernel choice (false: PolyKV's, the default).
var stockFlashAttn atomic.Bool

// SetFlashAttnKernel chooses the CPU flash-attention kernel for f16 K/V caches: PolyKV's
// (polykv true, the default; fattn.cpp says how it keeps logits independent of the batch)
// or the linked llama.cpp's own. The choice is process-wide (ggml-cpu has one
// registry of kernels) and applies to graphs computed from then on. Quantized caches,
// ALiBi and logit soft-capping always use ggml's kernel.
func SetFlashAttnKernel(polykv bool) {
	stockFlashAttn.Store(!polykv)
	C.polykv_fattn_enable(C.int(boolToInt(polykv)))
}

// FlashAttnKernelRuns counts the flash-attention nodes PolyKV's kernel has computed in
// this process (0 where it is unavailable: a CPU or build without AVX2 and FMA).
func FlashAttnKernelRuns() uint64 { return uint64(C.polykv_fattn_computed()) }

// FlashAttnOrderedRuns counts the flash-attention nodes PolyKV's kernel computed over a
// registered cache, summing each query's cells in position order (see
// Context.OrderedAttention).
func FlashAttnOrderedRuns() uint64 { return uint64(C.polykv_fattn_ordered()) }

// FlashAttnCastsSkipped counts llama.cpp's per-layer f16 casts of an f32 cache's K and
// V views that were left uncomputed because PolyKV's kernel reads the f32 views itself
// (each cast copies every used cell of the layer).
func FlashAttnCastsSkipped() uint64 { return uint64(C.polykv_fattn_casts_skipped()) }

// flashAttnInstalled: PolyKV's kernels are registered with ggml-cpu (AVX2 and FMA).
var flashAttnInstalled bool

// installFlashAttn registers PolyKV's kernels with ggml-cpu (once; it must follow the
// first model load, see fattn.cpp) and applies the current choices.
func installFlashAttn() {
	if C.polykv_fattn_install() != 0 {
		flashAttnInstalled = true
		C.polykv_fattn_enable(C.int(boolToInt(!stockFlashAttn.Load())))
		applyMatMulKernel()
	}
}

func boolToInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
