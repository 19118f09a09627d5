// PolyKV's CPU matrix kernel for Q4_1, Q4_K and Q6_K weights (kquant.cpp).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// polykv_kq_enable sets the process default (on: this kernel) for models that chose no
// kernel of their own (polykv_kq_model_choose), for graphs planned from now on (it is
// installed with the flash-attention kernel's extra buffer type, see fattn.cpp).
void polykv_kq_enable(int on);

struct llama_model;

// polykv_kq_model_choose records model's matrix kernel (kernel 1: this one, 2: ggml's)
// for products with its weights, whatever the process default; 0 if the table of
// choices is full (kquant.cpp).
int polykv_kq_model_choose(struct llama_model * model, int kernel);

// polykv_kq_model_forget drops model's choice (before llama_model_free, whose buffers a
// later model may get at the same addresses).
void polykv_kq_model_forget(struct llama_model * model);

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

// polykv_kq_traits claims op for the kernel: MUL_MAT of Q4_1/Q4_K/Q6_K weights whose
// model chose it (or, without a choice, when the process default is on).
ggml::cpu::tensor_traits * polykv_kq_traits(const ggml_tensor * op);

// polykv_kq_choose_buffer records the kernel for weights in buf (a ggml backend buffer),
// false if the table is full; polykv_kq_forget_buffer drops it. kquant_model.cpp calls
// them for each buffer of a model.
bool polykv_kq_choose_buffer(const void * buf, int kernel);
void polykv_kq_forget_buffer(const void * buf);
#endif
