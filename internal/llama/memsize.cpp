// See memsize.h. Reads llama.cpp internals (llama_hparams, llama_memory_recurrent): the
// per-layer geometry and the recurrent cache's tensors are not in its C API, so a bump
// that changes them fails to compile here, in the binding.

#include "memsize.h"

#include "llama-context.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"

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
