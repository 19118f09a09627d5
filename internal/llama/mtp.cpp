// See mtp.h.

#include "mtp.h"

#include "llama-ext.h"
#include "llama-model.h"

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
