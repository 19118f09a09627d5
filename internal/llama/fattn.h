// PolyKV's CPU flash-attention kernel for f16 caches (fattn.cpp).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// polykv_fattn_install registers the kernel with ggml-cpu once; 0 if this build or CPU
// cannot run it (no AVX2/FMA). Call it after the first model is loaded.
int polykv_fattn_install(void);

// polykv_fattn_enable sets the process default (on: PolyKV's kernel) for contexts that
// registered no choice of their own (polykv_cells_register), for graphs planned from now on.
void polykv_fattn_enable(int on);

// polykv_fattn_default is that default: 1 PolyKV's kernel, 0 ggml's.
int polykv_fattn_default(void);

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
