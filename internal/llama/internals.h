// What PolyKV reads or hooks of llama.cpp beyond its public headers (llama.h, ggml*.h),
// as a small C API (internals.cpp). internals.cpp is the only file that includes
// llama.cpp's private headers (src/*.h and ggml/src/ggml-cpu/*.h): a bump of the pinned
// llama.cpp that changes what it reads fails to compile there, and `make bump-llama`
// prints the upstream diff of exactly the headers it includes (scripts/llama.sh
// internals). Every function has a test (internals_test.go).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct llama_context;
struct ggml_tensor;

// --- Sequence memory sizes (llama_hparams, llama_memory_recurrent, memory_breakdown) ---

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

// --- MTP (NextN): llama.cpp's staging header src/llama-ext.h is C++ (it includes <map>),
// so cgo cannot include it; these wrap its calls. ---

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
bool polykv_model_mtp_loaded(const struct llama_model * model);

// --- Weights and KV cells (llama_model, llama_kv_cache, llama_kv_cells) ---

// polykv_model_host_buffers writes the distinct host (CPU-readable) backend buffers that
// hold model's weights to out (at most cap) and returns how many there are (GPU-resident
// weights are computed there, never by PolyKV's CPU kernels).
int polykv_model_host_buffers(const struct llama_model * model, const void ** out, int cap);

// polykv_attn_info is what polykv_attn_layers reports of a context as a whole.
struct polykv_attn_info {
    bool flash_attn; // the context computes attention with flash attention
    bool unknown;    // its memory is not one this reads (llama_kv_cache, alone, iSWA or
                     // in a hybrid): another kind, or a recurrent model's alone
    bool plain;      // the model uses neither ALiBi nor logit soft-capping
};

// polykv_attn_layer is one attention layer of one of a context's KV caches.
struct polykv_attn_layer {
    const void * cells;    // the cache's cells of stream 0 (polykv_cell_positions reads them)
    const void * kdata;    // the layer's K storage where the CPU reads it (NULL: on a GPU)
    size_t       kbytes;   // its size
    uint32_t     il;       // the layer's index in the model
    uint32_t     n_stream; // the cache's streams (1: unified)
    uint32_t     dk, dv;   // the layer's K and V head sizes
};

// polykv_attn_layers describes ctx's attention caches: it fills *info, writes the layers
// of every attention cache (cache by cache, each in its layer order) to out (at most cap)
// and returns how many there are.
int polykv_attn_layers(struct llama_context * ctx, struct polykv_attn_info * info, struct polykv_attn_layer * out, int cap);

// polykv_cell_positions writes the position each of n cells holds (idx: cell indices of
// cells, a polykv_attn_layer's) to pos; -1 for an empty cell.
void polykv_cell_positions(const void * cells, const uint32_t * idx, int n, int32_t * pos);

// --- ggml-cpu's extra-buffer-type hook (ggml-cpu/traits.h) ---

// polykv_compute is the part of ggml-cpu's compute parameters a PolyKV kernel reads:
// this thread's index of nth, and the graph's work buffer (wsize bytes at wdata).
struct polykv_compute {
    int    ith, nth;
    size_t wsize;
    void * wdata;
    void * threadpool; // for polykv_barrier
};

// polykv_barrier waits until every thread of the node's threadpool reaches it
// (ggml_barrier).
void polykv_barrier(const struct polykv_compute * c);

// A polykv_kernel is one of PolyKV's CPU kernels as ggml-cpu runs it: work_size sets the
// work buffer a node needs with n_threads threads; compute computes thread c->ith's share
// of op (false: the stock kernel computes it instead).
struct polykv_kernel {
    bool (*work_size)(int n_threads, const struct ggml_tensor * op, size_t * size);
    bool (*compute)(const struct polykv_compute * c, struct ggml_tensor * op);
};

// polykv_kernel_for is the kernel that computes op, or NULL for ggml's own (fattn.cpp:
// the dispatcher over PolyKV's kernels). ggml-cpu asks it about every node of every CPU
// graph of the process, from every compute thread.
const struct polykv_kernel * polykv_kernel_for(const struct ggml_tensor * op);

// polykv_hook_install registers polykv_kernel_for with ggml-cpu as a compute-only extra
// buffer type (once per process; it must follow the first model load: internals.cpp says
// why); the kernels are the ones polykv_kernel_for may return. 0 if the CPU device is
// missing.
int polykv_hook_install(const struct polykv_kernel * const * kernels, int n);

// polykv_hook_installed reports whether polykv_hook_install has succeeded.
int polykv_hook_installed(void);

// polykv_exp_row sets s[c] = exp(s[c] - max) for c in [0, n), n a multiple of 8, with
// ggml-cpu's vectorized expf (vec.h, the widest one the build targets), and -1 where
// s[c] is -inf (a cell the mask hides): the exponentials of PolyKV's flash-attention
// kernel. Only in builds with AVX2 and FMA (the kernel's).
void polykv_exp_row(float * s, int64_t n, float max);

#ifdef __cplusplus
}
#endif
