package llama

/*
#include "kquant.h"
*/
import "C"

import (
	"errors"
	"sync/atomic"
)

// stockMatMul is the process default matrix kernel (false: PolyKV's).
var stockMatMul atomic.Bool

// SetMatMulKernel sets the process default CPU kernel for matrix products with Q4_1, Q4_K
// and Q6_K weights, what models loaded with MatMulKernel KernelDefault use: PolyKV's
// (polykv true, the default; kquant.cpp says how it keeps a token's logits independent
// of the batch while unpacking each weight block once per product) or the stock ggml
// kernels of the linked llama.cpp, for graphs computed from then on (a default for the
// reason SetFlashAttnKernel gives); other weight types always use ggml's kernels.
func SetMatMulKernel(polykv bool) {
	stockMatMul.Store(!polykv)
	C.polykv_kq_enable(C.int(boolToInt(polykv)))
}

// MatMulKernelRuns counts the matrix products PolyKV's matrix kernel has computed in
// this process (0 where it is unavailable: a build without AVX2 and FMA).
func MatMulKernelRuns() uint64 { return uint64(C.polykv_kq_computed()) }

// MatMulKernelAvailable reports whether this build can run PolyKV's matrix kernel.
func MatMulKernelAvailable() bool { return C.polykv_kq_available() != 0 }

// applyMatMulKernel applies the current choice (called once the shared extra buffer
// type is installed, see installFlashAttn).
func applyMatMulKernel() { C.polykv_kq_enable(C.int(boolToInt(!stockMatMul.Load()))) }

// ggml type ids (ggml.h) of the weight types the kernel computes.
const (
	ggmlTypeQ41 = 3
	ggmlTypeQ4K = 12
	ggmlTypeQ6K = 14
)

// kquantSelfTest runs the kernel on a random m x k matrix of the given ggml type and n
// random activation rows (see polykv_kq_selftest): the largest difference from ggml's
// vec_dot relative to the largest |result|, whether computing the rows all at once, one
// at a time, three at a time and all at once one packed block at a time gave the same
// bits, and on how many instruction paths (AVX2, and VNNI where the CPU has it; the
// paths must agree to the bit too).
func kquantSelfTest(typ, m, k, n int, seed uint32) (maxRel float64, identical bool, paths int, err error) {
	var rel C.double
	var same, np C.int
	if C.polykv_kq_selftest(C.int(typ), C.int(m), C.int(k), C.int(n), C.uint(seed), &rel, &same, &np) != 0 {
		return 0, false, 0, errors.New("llama: matrix kernel self-test unavailable or bad shape")
	}
	return float64(rel), same != 0, int(np), nil
}

// MatMulKernelVNNI reports whether PolyKV's matrix kernel runs its AVX-512 VNNI path
// (chosen at run time where the CPU has it; otherwise its AVX2 path).
func MatMulKernelVNNI() bool { return C.polykv_kq_vnni() != 0 }

// setMatMulKernelVNNI turns the VNNI path on (where the CPU has it) or off, so tests run
// the plain AVX2 path a CPU without AVX-512 VNNI takes; it returns whether VNNI is now
// used. Process-wide, for graphs computed from then on.
func setMatMulKernelVNNI(on bool) bool { return C.polykv_kq_set_vnni(C.int(boolToInt(on))) != 0 }
