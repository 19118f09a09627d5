// Bytes of llama.cpp's sequence memory (memsize.cpp): what one KV cell and one sequence's
// recurrent state cost, read from the model's per-layer geometry and from the context's
// memory, so that pool and slot accounting holds for every architecture llama.cpp loads.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct llama_context;

// polykv_kv_bytes_per_cell is the size of one KV cell (one position, every layer that
// keeps K and V) with K and V caches of ggml types type_k and type_v. Per layer, not
// n_layer times one layer's size: recurrent layers of a hybrid keep no KV, layers that
// share another layer's KV (Gemma 3n/4) keep none of their own, and sliding-window and
// full layers may have different head sizes (Gemma 4).
int64_t polykv_kv_bytes_per_cell(const struct llama_model * model, int type_k, int type_v);

// polykv_recurrent_bytes_per_seq is the size of one sequence's recurrent state in ctx's
// memory: the recurrent cache's r and s tensors (every recurrent layer, rollback
// snapshots included) divided by its cells, one per sequence. 0 without recurrent layers.
int64_t polykv_recurrent_bytes_per_seq(struct llama_context * ctx);

// polykv_memory_bytes is the size of all of ctx's sequence memory (KV caches and
// recurrent state, every buffer), as llama.cpp itself reports it (memory_breakdown).
int64_t polykv_memory_bytes(struct llama_context * ctx);

#ifdef __cplusplus
}
#endif
