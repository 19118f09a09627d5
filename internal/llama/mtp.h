// llama.cpp's NextN (MTP) embeddings for Go (mtp.cpp): the calls live in llama.cpp's
// staging header src/llama-ext.h, which is C++ (it includes <map>), so cgo cannot include
// it; these are plain C wrappers around them.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_context;
struct llama_model;

// polykv_set_embeddings_nextn turns ctx's NextN output (h_nextn: the hidden state the LM
// head reads, per token) on or off; masked: rows only for the batch entries that ask for
// logits, else one row for every entry.
void polykv_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);

// polykv_set_nextn_layer_offset makes an MTP context's graph run NextN block offset (0:
// the first) of a model with several, which llama.cpp chains one per draft step.
void polykv_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);

// polykv_get_embeddings_nextn_ith is the NextN row of batch entry i from the last decode
// (unmasked: i is the entry's index in the batch; masked: as llama_get_logits_ith), or
// NULL (llama.cpp logs why).
float * polykv_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);

// polykv_model_mtp_loaded reports whether model's NextN layers were loaded (load_mtp) and
// carry the projection every MTP graph reads (nextn.eh_proj): an MTP context on a model
// without them aborts in llama.cpp's graph builder (GGML_ASSERT), so Go refuses it first.
// Reads llama_model's layers (llama-model.h): not in the C API.
bool polykv_model_mtp_loaded(const struct llama_model * model);

#ifdef __cplusplus
}
#endif
