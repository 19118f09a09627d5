// See internals.h. The only file of PolyKV that includes llama.cpp's private headers:
// everything below reads (or, for ggml-cpu's hook, implements) what llama.cpp keeps out
// of its C API, and returns it as plain C values, so that a bump of the pinned llama.cpp
// that changes any of it fails to compile here and nowhere else. The headers it includes
// are listed, one per line, between the markers below: `make bump-llama` diffs exactly
// those between the old and the new pin (scripts/llama.sh internals).

#include "internals.h"

#include <algorithm>
#include <atomic>
#include <vector>

// polykv-internals-begin
#include "ggml-cpu/traits.h"
#include "ggml-cpu/vec.h"
#include "llama-context.h"
#include "llama-ext.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"
// polykv-internals-end

// --- Sequence memory sizes ---

extern "C" int64_t polykv_kv_bytes_per_cell(const struct llama_model * model, int type_k, int type_v) {
    const llama_hparams & hp = model->hparams;
    int64_t n = 0;
    for (uint32_t il = 0; il < hp.n_layer(); il++) {
        if (hp.is_recr(il) || !hp.has_kv(il)) {
            continue;
        }
        n += (int64_t) ggml_row_size((ggml_type) type_k, hp.n_embd_k_gqa(il));
        if (!hp.is_mla()) { // MLA caches the latent in K only
            n += (int64_t) ggml_row_size((ggml_type) type_v, hp.n_embd_v_gqa(il));
        }
    }
    return n;
}

extern "C" int64_t polykv_recurrent_bytes_per_seq(struct llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    llama_memory_recurrent * rec = dynamic_cast<llama_memory_recurrent *>(mem);
    if (auto * hy = dynamic_cast<llama_memory_hybrid *>(mem)) {
        rec = hy->get_mem_recr();
    } else if (auto * hyi = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        rec = hyi->get_mem_recr();
    }
    if (rec == nullptr || rec->size == 0) {
        return 0;
    }
    int64_t n = 0;
    for (const ggml_tensor * t : rec->r_l) {
        n += t != nullptr ? (int64_t) ggml_nbytes(t) : 0;
    }
    for (const ggml_tensor * t : rec->s_l) {
        n += t != nullptr ? (int64_t) ggml_nbytes(t) : 0;
    }
    for (const ggml_tensor * t : rec->p_l) { // a second convolution history, where a model has one
        n += t != nullptr ? (int64_t) ggml_nbytes(t) : 0;
    }
    return n / rec->size;
}

extern "C" int64_t polykv_memory_bytes(struct llama_context * ctx) {
    llama_memory_i * mem = llama_get_memory(ctx);
    int64_t n = 0;
    if (mem != nullptr) {
        for (const auto & [buft, size] : mem->memory_breakdown()) {
            n += (int64_t) size;
        }
    }
    return n;
}

// --- MTP (NextN) ---

extern "C" void polykv_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

extern "C" void polykv_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset) {
    llama_set_nextn_layer_offset(ctx, offset);
}

extern "C" float * polykv_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

extern "C" bool polykv_model_mtp_loaded(const struct llama_model * model) {
    const llama_hparams & hp = model->hparams;
    for (uint32_t il = hp.n_layer(); il < hp.n_layer_all && il < model->layers.size(); il++) {
        if (model->layers[il].nextn.eh_proj != nullptr) {
            return true;
        }
    }
    return false;
}

// --- Weights and KV cells ---

extern "C" int polykv_model_host_buffers(const struct llama_model * model, const void ** out, int cap) {
    std::vector<const void *> bufs;
    for (const auto & [name, w] : model->tensors_by_name) {
        (void) name;
        if (w == nullptr || w->buffer == nullptr || !ggml_backend_buffer_is_host(w->buffer)) {
            continue;
        }
        const void * b = w->buffer;
        if (std::find(bufs.begin(), bufs.end(), b) == bufs.end()) {
            bufs.push_back(b);
        }
    }
    for (int i = 0; i < cap && i < (int) bufs.size(); i++) {
        out[i] = bufs[i];
    }
    return (int) bufs.size();
}

namespace {

// caches lists the attention caches of mem; unknown is set for a memory (or a cache) this
// cannot read: a recurrent-only model's (no attention cache) counts as one.
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
        unknown = true;
    }
    for (llama_kv_cache * kv : out) {
        unknown = unknown || kv == nullptr;
    }
    out.erase(std::remove(out.begin(), out.end(), nullptr), out.end());
}

}  // namespace

extern "C" int polykv_attn_layers(struct llama_context * ctx, struct polykv_attn_info * info, struct polykv_attn_layer * out, int cap) {
    const llama_hparams & hp = ctx->get_model().hparams;
    info->flash_attn = ctx->get_cparams().flash_attn;
    info->plain = !hp.use_alibi && !hp.attn_soft_cap;
    info->unknown = false;
    std::vector<llama_kv_cache *> kvs;
    caches(llama_get_memory(ctx), kvs, info->unknown);
    int n = 0;
    for (llama_kv_cache * kv : kvs) {
        for (uint32_t il : kv->get_layer_ids()) {
            if (n < cap) {
                polykv_attn_layer & l = out[n];
                ggml_tensor * k = kv->get_k_storage((int32_t) il);
                const bool host = k != nullptr && k->data != nullptr && k->buffer != nullptr && ggml_backend_buffer_is_host(k->buffer);
                l.cells = &kv->get_cells(0);
                l.kdata = host ? k->data : nullptr;
                l.kbytes = host ? ggml_nbytes(k) : 0;
                l.il = il;
                l.n_stream = kv->get_n_stream();
                l.dk = hp.n_embd_head_k(il);
                l.dv = hp.n_embd_head_v(il);
            }
            n++;
        }
    }
    return n;
}

extern "C" void polykv_cell_positions(const void * cells_, const uint32_t * idx, int n, int32_t * pos) {
    const llama_kv_cells * cells = (const llama_kv_cells *) cells_;
    for (int i = 0; i < n; i++) {
        // An empty cell (never seen among a query's visible ones) sorts first rather than
        // tripping llama.cpp's assert.
        pos[i] = cells->is_empty(idx[i]) ? -1 : cells->pos_get(idx[i]);
    }
}

// --- ggml-cpu's extra-buffer-type hook ---
//
// ggml-cpu asks every registered "extra buffer type" for tensor traits before it runs a
// node's stock kernel (ggml_cpu_extra_compute_forward). PolyKV registers one that owns no
// memory and claims the nodes its kernels compute (polykv_kernel_for, fattn.cpp). The
// list of extras is process-wide and get_tensor_traits is handed the node alone, so the
// hook is one per process; whose choice of kernel applies to a node is read from the
// node's tensors (a context's K cache, a model's weight buffers: cellorder.cpp,
// kquant.cpp).

extern "C" void polykv_barrier(const struct polykv_compute * c) {
    ggml_barrier((struct ggml_threadpool *) c->threadpool);
}

namespace {

// adaptor runs a polykv_kernel as ggml-cpu's tensor traits.
class adaptor : public ggml::cpu::tensor_traits {
  public:
    const polykv_kernel * k = nullptr;

    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override { return k->work_size(n_threads, op, &size); }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        const polykv_compute c{params->ith, params->nth, params->wsize, params->wdata, params->threadpool};
        return k->compute(&c, op);
    }
};

constexpr int kMaxKernels = 8;
adaptor adaptors[kMaxKernels];
int n_adaptors = 0;
std::atomic<bool> hooked{false};

class extra : public ggml::cpu::extra_buffer_type {
  public:
    bool supports_op(ggml_backend_dev_t, const ggml_tensor *) override { return false; }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        const polykv_kernel * k = polykv_kernel_for(op);
        for (int i = 0; k != nullptr && i < n_adaptors; i++) {
            if (adaptors[i].k == k) {
                return &adaptors[i];
            }
        }
        return nullptr;
    }
};

}  // namespace

extern "C" int polykv_hook_install(const struct polykv_kernel * const * kernels, int n) {
    static bool installed = [&] {
        // The CPU device hands llama.cpp's model loader a copy of the extra buffer types
        // made on first use; make that copy now, without us, so no weight is ever placed
        // in (or asks anything of) our buffer type, which allocates nothing.
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (dev == nullptr || n > kMaxKernels) {
            return false;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        if (get != nullptr) {
            (void) get(dev);
        }
        for (int i = 0; i < n; i++) {
            adaptors[i].k = kernels[i];
        }
        n_adaptors = n;
        static extra ctx;
        static ggml_backend_buffer_type buft = {};
        buft.device = dev;
        buft.context = &ctx;
        ggml_backend_cpu_get_extra_buffer_types().push_back(&buft);
        return true;
    }();
    hooked.store(installed);
    return installed ? 1 : 0;
}

extern "C" int polykv_hook_installed(void) { return hooked.load() ? 1 : 0; }

#if defined(__AVX2__) && defined(__FMA__)

extern "C" void polykv_exp_row(float * s, int64_t n, float max) {
    const __m256 M = _mm256_set1_ps(max);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t c0 = 0; c0 < n; c0 += 8) {
        const __m256 x = _mm256_loadu_ps(s + c0);
        const __m256 hidden = _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ);
#if defined(__AVX512F__)
        const __m256 e = _mm512_castps512_ps256(ggml_v_expf(_mm512_zextps256_ps512(_mm256_sub_ps(x, M))));
#else
        const __m256 e = ggml_v_expf(_mm256_sub_ps(x, M));
#endif
        _mm256_storeu_ps(s + c0, _mm256_blendv_ps(e, _mm256_set1_ps(-1.0f), hidden));
    }
}

#else

extern "C" void polykv_exp_row(float *, int64_t, float) {}

#endif
