package llama

/*
#include "fattn.h"
*/
import "C"

import "sync/atomic"

// Kernel chooses a CPU kernel: PolyKV's own or the linked llama.cpp's (ggml's). A
// context chooses its flash-attention kernel (ContextParams.AttnKernel) and a model its
// matrix kernel (ModelParams.MatMulKernel), so a target and a draft model in one process
// may differ.
type Kernel int

const (
	// KernelDefault follows the process default as it is when a graph is computed
	// (SetFlashAttnKernel, SetMatMulKernel: PolyKV's unless changed).
	KernelDefault Kernel = iota
	// KernelPolyKV is PolyKV's kernel (fattn.cpp, kquant.cpp).
	KernelPolyKV
	// KernelGGML is the linked llama.cpp's own.
	KernelGGML
)

// KernelNamed is the kernel a --fa-kernel or --mm-kernel value names: "ggml" is
// llama.cpp's, anything else PolyKV's (the flags are checked before).
func KernelNamed(name string) Kernel {
	if name == "ggml" {
		return KernelGGML
	}
	return KernelPolyKV
}

func (k Kernel) valid() bool { return k >= KernelDefault && k <= KernelGGML }

// stockFlashAttn is the process default (false: PolyKV's).
var stockFlashAttn atomic.Bool

// SetFlashAttnKernel sets the process default CPU flash-attention kernel, what contexts
// created with AttnKernel KernelDefault use: PolyKV's (polykv true, the default;
// fattn.cpp says how it keeps logits independent of the batch) or the linked llama.cpp's
// own, for graphs computed from then on. A default and not only a per-context choice so
// that one loaded model can be compared under both kernels (the prefill benchmark, the
// kernel tests) without threading the choice through every helper; the server passes
// its choice per context. Quantized caches other than q8_0 and q4_0, ALiBi and logit
// soft-capping always use ggml's kernel.
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
