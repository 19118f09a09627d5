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
// What it needs of llama.cpp's internals (which caches a context has, their layers' K
// storage, the positions of cells) it reads through internals.h.

#include "cellorder.h"
#include "fattn.h"
#include "internals.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace {

struct layer_ref {
    const void * kdata;
    const void * cells; // the cache's cells (polykv_cell_positions)
    bool         first;
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
    // kernel: the context's flash-attention kernel (ContextParams.AttnKernel: 1 PolyKV's,
    // 2 ggml's). A context's own because ggml-cpu asks its extras about a node, not a
    // context: the node's K view (in spans) is what tells whose node it is.
    int                kernel = 1;
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

// chosen resolves a registration's kernel choice.
bool chosen(const registration & r) { return r.kernel != 2; }

}  // namespace

extern "C" int polykv_cells_register(struct llama_context * ctx, int order, int kernel) {
    polykv_attn_info info;
    std::vector<polykv_attn_layer> layers(64);
    int n = polykv_attn_layers(ctx, &info, layers.data(), (int) layers.size());
    if (n > (int) layers.size()) {
        layers.resize(n);
        n = polykv_attn_layers(ctx, &info, layers.data(), n);
    }
    layers.resize(n);
    if (!info.flash_attn) {
        return 0; // the plain attention path (matrix products over all cells) is not ours
    }
    registration r;
    r.ctx = ctx;
    r.kernel = kernel;
    r.fa_ok = info.plain;
    uint32_t first_il = UINT32_MAX;
    bool ok = !info.unknown && order != 0;
    for (const polykv_attn_layer & l : layers) {
        // Every host K storage tells the kernel choice, whether or not it can be ordered.
        if (l.kdata != nullptr) {
            r.spans.push_back({(const char *) l.kdata, (const char *) l.kdata + l.kbytes});
        }
        if (l.n_stream != 1) {
            ok = false; // one stream per sequence: the kernel could not tell which stream a view is
            continue;
        }
        if (l.kdata == nullptr) {
            ok = false; // offloaded to a GPU: computed there, not by this kernel
            continue;
        }
        r.layers.push_back({l.kdata, l.cells, false});
        r.fa_ok = r.fa_ok && l.dk % 32 == 0 && l.dv % 32 == 0 && l.dk <= 256 && l.dv <= 256;
        first_il = std::min(first_il, l.il);
    }
    // The first attention layer starts every graph: the kernel drops what it cached for
    // the previous one there.
    size_t i = 0;
    for (const polykv_attn_layer & l : layers) {
        if (l.n_stream == 1 && l.kdata != nullptr) {
            r.layers[i++].first = l.il == first_il;
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
    return true; // a cache no context registered (none of NewContext's): PolyKV's, the default
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

void polykv_visible_runs(const void * cells, const uint16_t * mrow, int64_t nkv, std::vector<polykv_run> & out) {
    constexpr uint16_t kNegInf = 0xFC00; // -inf in f16: how llama.cpp's mask hides a cell
    out.clear();
    // The visible cells first (the mask alone), then their positions in one call.
    thread_local std::vector<uint32_t> vis;
    thread_local std::vector<int32_t>  pos;
    vis.clear();
    const __m256i hidden = _mm256_set1_epi16((short) kNegInf);
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
        if (mrow[c] != kNegInf) {
            vis.push_back((uint32_t) c);
        }
        c++;
    }
    pos.resize(vis.size());
    if (cells == nullptr) {
        for (size_t i = 0; i < vis.size(); i++) {
            pos[i] = (int32_t) vis[i];
        }
    } else {
        // A visible cell holds a token of the query's sequence, so it is not empty; an
        // empty one (never seen) sorts first (position -1).
        polykv_cell_positions(cells, vis.data(), (int) vis.size(), pos.data());
    }
    bool sorted = true;
    for (size_t i = 0; i < vis.size(); i++) {
        const uint32_t cc = vis[i];
        const int32_t  p = pos[i];
        if (!out.empty() && out.back().cell + out.back().len == cc && out.back().pos + (int32_t) out.back().len == p) {
            out.back().len++;
        } else {
            if (!out.empty() && out.back().pos + (int32_t) out.back().len > p) {
                sorted = false;
            }
            out.push_back({cc, p, 1});
        }
    }
    if (!sorted) {
        // Positions of one sequence are distinct, so runs of one query never overlap and
        // this is the query's cells in position order.
        std::sort(out.begin(), out.end(), [](const polykv_run & a, const polykv_run & b) {
            return a.pos != b.pos ? a.pos < b.pos : a.cell < b.cell;
        });
    }
}
