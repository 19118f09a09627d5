// Where a flash-attention node's KV cells sit and which positions they hold
// (cellorder.cpp): what lets PolyKV's attention kernel visit a query's visible cells in
// position order, wherever llama.cpp placed them.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
#include <vector>

// polykv_run is a run of consecutive cells holding consecutive positions:
// cells [cell, cell+len) hold positions [pos, pos+len).
struct polykv_run {
    uint32_t cell;
    int32_t  pos;
    uint32_t len;
};

// polykv_cells_find looks up the registered KV cache whose layer's K storage starts at
// kdata (a flash-attention node's K view of the unified cache starts at its cell 0).
// It returns the cache's cells (opaque; nullptr when kdata is not a registered layer)
// and sets first when that layer is the first attention layer of its context: the first
// flash-attention node of every graph that context computes.
const void * polykv_cells_find(const void * kdata, bool * first);

// polykv_cells_mark_stock records that a flash-attention node over kdata's cache ran
// another kernel than PolyKV's (see polykv_cells_ordered).
void polykv_cells_mark_stock(const void * kdata);

// An f32 cache under flash attention: llama.cpp casts each layer's whole K and V views
// to f16 before the attention node (llama-graph.cpp, build_attn_mha), a copy of every
// used cell per layer and step. PolyKV's kernel reads the f32 views under the casts
// instead, so the casts may be skipped where nothing else reads them:
// polykv_cells_learn_v records the V storage (vdata) used beside the K storage kdata,
// and polykv_cells_cast_skippable reports whether data is a registered K or V storage of
// a context whose every attention node PolyKV's kernel computes.
void polykv_cells_learn_v(const void * kdata, const void * vdata);
bool polykv_cells_cast_skippable(const void * data);

// polykv_fattn_chosen reports whether the context whose cache holds kdata (a
// flash-attention node's K view) chose PolyKV's kernel (polykv_cells_register's kernel;
// PolyKV's for a cache no context registered).
bool polykv_fattn_chosen(const void * kdata);

// polykv_visible_runs fills out with the cells in [0, nkv) that the f16 mask row lets
// through (-inf hides a cell), as runs ordered by (position, cell). cells nullptr:
// ordered by cell index (no positions known).
void polykv_visible_runs(const void * cells, const uint16_t * mask_row, int64_t nkv, std::vector<polykv_run> & out);

extern "C" {
#endif

struct llama_context;

// polykv_cells_register records ctx's flash-attention kernel (kernel: 1 PolyKV's, 2
// ggml's) and, where order is 1, its attention caches (unified,
// one stream) so its flash-attention nodes can be ordered by position; 1 if every
// attention cache of ctx was recorded for ordering, 0 if order is 0 or ctx has one this
// cannot read (the caller then keeps cells ordered by compaction).
int polykv_cells_register(struct llama_context * ctx, int order, int kernel);

// polykv_cells_ordered is 1 while ctx is registered for ordering, uses PolyKV's kernel
// and every flash-attention node of it has run that kernel (cells summed in position
// order), else 0.
int polykv_cells_ordered(struct llama_context * ctx);

// polykv_cells_unregister forgets ctx (before llama_free).
void polykv_cells_unregister(struct llama_context * ctx);

#ifdef __cplusplus
}
#endif
