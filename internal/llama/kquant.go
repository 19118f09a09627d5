package llama

/*
#include "kquant.h"
*/
import "C"

import (
	"errors"
	"fmt"
)

// SetMatMulKernel sets m's CPU kernel for matrix products with its Q4_1, Q4_K and Q6_K
// weights, for graphs computed from then on (ModelParams.MatMulKernel is the one it is
// loaded with): PolyKV's (kquant.cpp says how it keeps a token's logits independent of
// the batch while unpacking each weight block once per product) or the stock ggml kernels
// of the linked llama.cpp; other weight types always use ggml's kernels. The choice is
// the model's: every context of it shares its weights, other models keep theirs.
func (m *Model) SetMatMulKernel(k Kernel) error {
	if k < KernelPolyKV || k > kernelPolyKVAVX2 {
		return fmt.Errorf("unknown matrix kernel %d", k)
	}
	if C.polykv_kq_model_choose(m.m, k.code()) == 0 {
		return errors.New("too many models with a matrix kernel of their own are loaded")
	}
	return nil
}

// MatMulKernelRuns counts the matrix products PolyKV's matrix kernel has computed in
// this process (0 where it is unavailable: a build without AVX2 and FMA).
func MatMulKernelRuns() uint64 { return uint64(C.polykv_kq_computed()) }

// MatMulKernelAvailable reports whether this build can run PolyKV's matrix kernel.
func MatMulKernelAvailable() bool { return C.polykv_kq_available() != 0 }

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
// (chosen at run time where the CPU has it; otherwise its AVX2 path). A model may choose
// the AVX2 path (tests: what a CPU without AVX-512 VNNI runs).
func MatMulKernelVNNI() bool { return C.polykv_kq_vnni() != 0 }
