package llama

/*
#include "fattn.h"
#include "internals.h"
*/
import "C"

// Kernel chooses a CPU kernel: PolyKV's own or the linked llama.cpp's (ggml's). A
// context chooses its flash-attention kernel (ContextParams.AttnKernel) and a model its
// matrix kernel (ModelParams.MatMulKernel, Model.SetMatMulKernel), so a target and a
// draft model, or two servers, in one process may differ. There is no process-wide
// choice: ggml-cpu's hook that runs PolyKV's kernels is one per process (its list of
// extra buffer types is global, and it is asked about a graph node alone), so the hook
// reads whose choice applies from the node's tensors: the K cache it attends over tells
// the context (cellorder.cpp), the weights' buffer the model (kquant.cpp).
type Kernel int

const (
	// KernelPolyKV is PolyKV's kernel (fattn.cpp, kquant.cpp): the zero value, what a
	// context or model uses unless it chooses otherwise.
	KernelPolyKV Kernel = iota
	// KernelGGML is the linked llama.cpp's own.
	KernelGGML
	// kernelPolyKVAVX2 (matrix kernel only; tests) is PolyKV's matrix kernel on its AVX2
	// path, what a CPU without AVX-512 VNNI runs, where this one would run VNNI.
	kernelPolyKVAVX2
)

// KernelNamed is the kernel a --fa-kernel or --mm-kernel value names: "ggml" is
// llama.cpp's, anything else PolyKV's (the flags are checked before).
func KernelNamed(name string) Kernel {
	if name == "ggml" {
		return KernelGGML
	}
	return KernelPolyKV
}

// code is the kernel's number in the C API (cellorder.h, kquant.h).
func (k Kernel) code() C.int {
	switch k {
	case KernelGGML:
		return 2
	case kernelPolyKVAVX2:
		return 3
	}
	return 1
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

// installKernels registers PolyKV's kernels with ggml-cpu (once per process; it must
// follow the first model load, see internals.cpp).
func installKernels() { C.polykv_fattn_install() }

// kernelsInstalled reports whether PolyKV's kernels are registered with ggml-cpu (AVX2
// and FMA).
func kernelsInstalled() bool { return C.polykv_hook_installed() != 0 }
