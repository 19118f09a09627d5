// PolyKV's CPU matrix kernel for Q4_1, Q4_K and Q6_K weights (kquant.cpp).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;

// polykv_kq_model_choose records model's matrix kernel for products with its weights,
// for graphs planned from then on: kernel 1 this one (on the CPU's best path: the
// default, which needs no record), 2 ggml's, 3 this one on its AVX2 path (what a CPU
// without AVX-512 VNNI runs; tests). 0 if the table of choices is full (kquant.cpp).
int polykv_kq_model_choose(struct llama_model * model, int kernel);

// polykv_kq_model_forget drops model's choice (before llama_model_free, whose buffers a
// later model may get at the same addresses).
void polykv_kq_model_forget(struct llama_model * model);

// polykv_kq_computed counts the matrix products the kernel has computed.
unsigned long long polykv_kq_computed(void);

// polykv_kq_available is 0 where this build cannot run the kernel (no AVX2/FMA).
int polykv_kq_available(void);

// polykv_kq_vnni reports whether the kernel's best path on this CPU is AVX-512 VNNI.
int polykv_kq_vnni(void);

// polykv_kq_selftest checks the kernel on random data (see kquant.cpp); 0 on success.
int polykv_kq_selftest(int type, int M, int K, int N, unsigned seed, double * max_rel, int * identical, int * paths);

#ifdef __cplusplus
}

struct ggml_tensor;
struct polykv_kernel;

// polykv_kq_kernel_for is the kernel computing op (fattn.cpp's dispatcher asks): MUL_MAT
// of Q4_1/Q4_K/Q6_K weights whose model did not choose ggml's kernel; nullptr otherwise.
const polykv_kernel * polykv_kq_kernel_for(const ggml_tensor * op);

// polykv_kq_kernel is the kernel on the CPU's best path, or on its AVX2 path (avx2_only),
// for the hook's list (polykv_hook_install).
const polykv_kernel * polykv_kq_kernel(bool avx2_only);
#endif
