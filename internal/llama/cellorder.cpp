// The KV cells behind PolyKV's flash-attention kernel, read from llama.cpp's KV cache.
//
// Why: a token's attention output is a sum over the cells its sequence sees, and a float
// sum depends on its order. llama.cpp puts a batch's tokens into the first free cells it
// finds, so after other sequences free cells, a running sequence's next cells can land
// below its older ones: in cell order its sum would differ from a quiet server's. PolyKV
// used to compact the whole cache after every free to keep cell order == position order
// (copying every used cell, other tenants' included, out and back in). Instead the
// kernel now sums each query's visible cells in position order, which is the cell order
// of a quiet server, wherever the cells are: this file tells it the positions.
//
// It reads llama.cpp internals (llama_kv_cache, llama_kv_cells), so a bump of the pinned
// llama.cpp that changes them fails to compile here, in the binding, as it should.

#include "cellorder.h"
#include "fattn.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include "llama-context.h"
#include "llama-model.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"

namespace {

struct layer_ref {
    const void *           kdata;
    const llama_kv_cells * cells;
    bool                   first;
};

// kspan is one K storage of a context's cache, [begin, end): a flash-attention node's K
// view lies inside one (a view of a later stream starts past begin).
struct kspan {
    const char * begin;
    const char * end;
};

struct registration {
    const llama_context *  ctx = nullptr;
    std::vector<layer_ref> layers; // empty unless ordered
    // ordered: the kernel may sum this context's cells in position order (layers lists
    // every attention layer); otherwise it still runs, in cell order, and the context
    // compacts.
    bool ordered = false;
    // kernel: the context's flash-attention kernel (ContextParams.AttnKernel: 0 the
    // process default, polykv_fattn_default; 1 PolyKV's; 2 ggml's). A context's own
    // because ggml-cpu asks its extras about a node, not a context: the node's K view
    // (in spans) is what tells whose node it is.
    int                kernel = 0;
    std::vector<kspan> spans;
    // stock: one of ctx's attention nodes ran another kernel (ggml's: ALiBi, soft-capping,
    // a head size PolyKV's kernel does not take), which sums in cell order.
    std::shared_ptr<std::atomic<bool>> stock = std::make_shared<std::atomic<bool>>(false);
    // fa_ok: every attention layer is one PolyKV's kernel takes (no ALiBi, no soft-capping,
    // head sizes it handles), so an f32 cache's casts to f16 may be skipped (see
    // polykv_cells_cast_skippable).
    bool fa_ok = false;
    // vdata: V storages seen beside this context's K in flash-attention nodes.
    std::shared_ptr<std::vector<const void *>> vdata = std::make_shared<std::vector<const void *>>();
};

std::shared_mutex        mu;
std::vector<registration> reg; // few contexts: a linear search is enough

// caches lists the attention caches of mem (nullptr entries for kinds this cannot read).
void caches(llama_memory_i * mem, std::vector<llama_kv_cache *> & out, bool & unknown) {
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        out.push_back(kv);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        out.push_back(iswa->get_base());
        out.push_back(iswa->get_swa());
    } else if (auto * hy = dynamic_cast<llama_memory_hybrid *>(mem)) {
        out.push_back(hy->get_mem_attn());
    } else if (auto * hyi = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        out.push_back(hyi->get_mem_attn()->get_base());
        out.push_back(hyi->get_mem_attn()->get_swa());
    } else if (mem != nullptr) {
        unknown = true; // recurrent-only models have no attention cache; others: not read
    }
}

// chosen resolves a registration's kernel choice (the process default where it has none).
bool chosen(const registration & r) {
    return r.kernel == 1 || (r.kernel == 0 && polykv_fattn_default() != 0);
}

// host_k is layer il's K storage where this kernel could read it (nullptr on a GPU).
ggml_tensor * host_k(llama_kv_cache * kv, uint32_t il) {
    ggml_tensor * k = kv->get_k_storage((int32_t) il);
    if (k == nullptr || k->data == nullptr || k->buffer == nullptr || !ggml_backend_buffer_is_host(k->buffer)) {
        return nullptr;
    }
    return k;
}

}  // namespace

extern "C" int polykv_cells_register(struct llama_context * ctx, int order, int kernel) {
    if (!ctx->get_cparams().flash_attn) {
        return 0; // the plain attention path (matrix products over all cells) is not ours
    }
    llama_memory_i * mem = llama_get_memory(ctx);
    std::vector<llama_kv_cache *> kvs;
    bool unknown = false;
    caches(mem, kvs, unknown);
    registration r;
    r.ctx = ctx;
    r.kernel = kernel;
    const llama_hparams & hp = ctx->get_model().hparams;
    r.fa_ok = !hp.use_alibi && !hp.attn_soft_cap;
    uint32_t first_il = UINT32_MAX;
    bool ok = !unknown && order != 0;
    for (llama_kv_cache * kv : kvs) {
        if (kv == nullptr) {
            ok = false;
            continue;
        }
        // Every host K storage tells the kernel choice, whether or not it can be ordered.
        for (uint32_t il : kv->get_layer_ids()) {
            if (ggml_tensor * k = host_k(kv, il)) {
                r.spans.push_back({(const char *) k->data, (const char *) k->data + ggml_nbytes(k)});
            }
        }
        if (kv->get_n_stream() != 1) {
            ok = false; // one stream per sequence: the kernel could not tell which stream a view is
            continue;
        }
        const llama_kv_cells * cells = &kv->get_cells(0);
        for (uint32_t il : kv->get_layer_ids()) {
            ggml_tensor * k = host_k(kv, il);
            if (k == nullptr) {
                ok = false; // offloaded to a GPU: computed there, not by this kernel
                continue;
            }
            r.layers.push_back({k->data, cells, false});
            const uint32_t dk = hp.n_embd_head_k(il), dv = hp.n_embd_head_v(il);
            r.fa_ok = r.fa_ok && dk % 32 == 0 && dv % 32 == 0 && dk <= 256 && dv <= 256;
            first_il = std::min(first_il, il);
        }
    }
    // The first attention layer starts every graph: the kernel drops what it cached for
    // the previous one there.
    size_t i = 0;
    for (llama_kv_cache * kv : kvs) {
        if (kv == nullptr || kv->get_n_stream() != 1) {
            continue;
        }
        for (uint32_t il : kv->get_layer_ids()) {
            if (host_k(kv, il) == nullptr) {
                continue;
            }
            r.layers[i++].first = il == first_il;
        }
    }
    r.ordered = ok && !r.layers.empty();
    if (!r.ordered) {
        r.layers.clear(); // some attention layer cannot be ordered: the caller compacts instead
    }
    std::unique_lock<std::shared_mutex> lock(mu);
    reg.erase(std::remove_if(reg.begin(), reg.end(), [&](const registration & x) { return x.ctx == ctx; }), reg.end());
    const int ordered = r.ordered ? 1 : 0;
    reg.push_back(std::move(r));
    return ordered;
}

extern "C" void polykv_cells_unregister(struct llama_context * ctx) {
    std::unique_lock<std::shared_mutex> lock(mu);
    reg.erase(std::remove_if(reg.begin(), reg.end(), [&](const registration & x) { return x.ctx == ctx; }), reg.end());
}

bool polykv_fattn_chosen(const void * kdata) {
    const char * k = (const char *) kdata;
    std::shared_lock<std::shared_mutex> lock(mu);
    for (const registration & r : reg) {
        for (const kspan & x : r.spans) {
            if (k >= x.begin && k < x.end) {
                return chosen(r);
            }
        }
    }
    return polykv_fattn_default() != 0; // a cache no context registered (none of NewContext's)
}

const void * polykv_cells_find(const void * kdata, bool * first) {
    std::shared_lock<std::shared_mutex> lock(mu);
    for (const registration & r : reg) {
        for (const layer_ref & l : r.layers) {
            if (l.kdata == kdata) {
                *first = l.first;
                return l.cells;
            }
        }
    }
    *first = false;
    return nullptr;
}

void polykv_cells_mark_stock(const void * kdata) {
    std::shared_lock<std::shared_mutex> lock(mu);
    for (const registration & r : reg) {
        for (const layer_ref & l : r.layers) {
            if (l.kdata == kdata) {
                r.stock->store(true);
                return;
            }
        }
    }
}

extern "C" int polykv_cells_ordered(struct llama_context * ctx) {
    std::shared_lock<std::shared_mutex> lock(mu);
    for (const registration & r : reg) {
        if (r.ctx == ctx) {
            return r.ordered && chosen(r) && !r.stock->load() ? 1 : 0;
        }
    }
    return 0;
}

void polykv_cells_learn_v(const void * kdata, const void * vdata) {
    {
        std::shared_lock<std::shared_mutex> lock(mu);
        for (const registration & r : reg) {
            for (const layer_ref & l : r.layers) {
                if (l.kdata == kdata) {
                    if (std::find(r.vdata->begin(), r.vdata->end(), vdata) != r.vdata->end()) {
                        return;
                    }
                    goto learn;
                }
            }
        }
        return;
    }
learn:
    std::unique_lock<std::shared_mutex> lock(mu);
    for (registration & r : reg) {
        for (const layer_ref & l : r.layers) {
            if (l.kdata == kdata) {
                if (std::find(r.vdata->begin(), r.vdata->end(), vdata) == r.vdata->end()) {
                    r.vdata->push_back(vdata);
                }
                return;
            }
        }
    }
}

bool polykv_cells_cast_skippable(const void * data) {
    std::shared_lock<std::shared_mutex> lock(mu);
    for (const registration & r : reg) {
        if (!r.ordered || !r.fa_ok || r.stock->load() || !chosen(r)) {
            continue;
        }
        for (const layer_ref & l : r.layers) {
            if (l.kdata == data) {
                return true;
            }
        }
        if (std::find(r.vdata->begin(), r.vdata->end(), data) != r.vdata->end()) {
            return true;
        }
    }
    return false;
}

void polykv_visible_runs(const void * cells_, const uint16_t * mrow, int64_t nkv, std::vector<polykv_run> & out) {
    const llama_kv_cells * cells = (const llama_kv_cells *) cells_;
    constexpr uint16_t kNegInf = 0xFC00; // -inf in f16: how llama.cpp's mask hides a cell
    out.clear();
    const __m256i hidden = _mm256_set1_epi16((short) kNegInf);
    bool sorted = true;
    int64_t c = 0;
    while (c < nkv) {
        // Whole stretches of other sequences' cells are skipped 16 at a time.
        if (c + 16 <= nkv && (c & 15) == 0) {
            const __m256i m = _mm256_loadu_si256((const __m256i *) (mrow + c));
            if ((uint32_t) _mm256_movemask_epi8(_mm256_cmpeq_epi16(m, hidden)) == 0xFFFFFFFFu) {
                c += 16;
                continue;
            }
        }
        if (mrow[c] == kNegInf) {
            c++;
            continue;
        }
        // A visible cell holds a token of the query's sequence, so it is not empty; an
        // empty one (never seen) sorts first rather than tripping llama.cpp's assert.
        const int32_t p = cells == nullptr ? (int32_t) c : cells->is_empty((uint32_t) c) ? -1 : cells->pos_get((uint32_t) c);
        if (!out.empty() && out.back().cell + out.back().len == (uint32_t) c && out.back().pos + (int32_t) out.back().len == p) {
            out.back().len++;
        } else {
            if (!out.empty() && out.back().pos + (int32_t) out.back().len > p) {
                sorted = false;
            }
            out.push_back({(uint32_t) c, p, 1});
        }
        c++;
    }
    if (!sorted) {
        // Positions of one sequence are distinct, so runs of one query never overlap and
        // this is the query's cells in position order.
        std::sort(out.begin(), out.end(), [](const polykv_run & a, const polykv_run & b) {
            return a.pos != b.pos ? a.pos < b.pos : a.cell < b.cell;
        });
    }
}
