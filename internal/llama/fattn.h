// PolyKV's CPU flash-attention kernel for f16 caches (fattn.cpp).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// polykv_fattn_install registers PolyKV's kernels (this one and the matrix kernel,
// kquant.cpp) with ggml-cpu once (internals.h: polykv_hook_install); 0 if this build or
// CPU cannot run them (no AVX2/FMA). Call it after the first model is loaded. Which
// kernel computes a node is its context's choice (polykv_cells_register) or its model's
// (polykv_kq_model_choose); there is no process-wide one.
int polykv_fattn_install(void);

// polykv_fattn_computed counts the flash-attention nodes the kernel has computed.
unsigned long long polykv_fattn_computed(void);

// polykv_fattn_ordered counts those of them whose cells it summed in position order
// (their context registered with polykv_cells_register).
unsigned long long polykv_fattn_ordered(void);

// polykv_fattn_casts_skipped counts llama.cpp's f16 casts of f32 cache views left
// uncomputed because this kernel reads the f32 views (cellorder.h).
unsigned long long polykv_fattn_casts_skipped(void);

#ifdef __cplusplus
}
#endif
