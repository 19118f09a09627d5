// PolyKV's CPU matrix kernel for Q4_1, Q4_K and Q6_K weights (kquant.cpp).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// polykv_kq_enable turns the kernel on or off for graphs planned from now on (it is
// installed with the flash-attention kernel's extra buffer type, see fattn.cpp).
void polykv_kq_enable(int on);

// polykv_kq_computed counts the matrix products the kernel has computed.
unsigned long long polykv_kq_computed(void);

// polykv_kq_available is 0 where this build cannot run the kernel (no AVX2/FMA).
int polykv_kq_available(void);

// polykv_kq_set_vnni chooses the AVX-512 VNNI path (on, where the CPU has it) or the AVX2
// path; it returns whether VNNI is now used. The default is VNNI where available.
int polykv_kq_set_vnni(int on);

// polykv_kq_vnni reports whether the AVX-512 VNNI path is in use.
int polykv_kq_vnni(void);

// polykv_kq_selftest checks the kernel on random data (see kquant.cpp); 0 on success.
int polykv_kq_selftest(int type, int M, int K, int N, unsigned seed, double * max_rel, int * identical, int * paths);

#ifdef __cplusplus
}

struct ggml_tensor;
namespace ggml::cpu {
class tensor_traits;
}

// polykv_kq_traits claims op for the kernel: MUL_MAT of Q4_1/Q4_K/Q6_K weights when enabled.
ggml::cpu::tensor_traits * polykv_kq_traits(const ggml_tensor * op);
#endif
