// A model's matrix-kernel choice, recorded by its weights' buffers (kquant.cpp says why
// per model). Apart from kquant.cpp because it reads llama.cpp's model internals
// (llama_model::tensors_by_name), as cellorder.cpp does its KV cache's.

#include "kquant.h"

#include <vector>

#include "llama-model.h"

namespace {

// weight_buffers lists the distinct host buffers holding model's weights (GPU-resident
// weights are computed there, never by this kernel).
std::vector<const void *> weight_buffers(const llama_model * model) {
    std::vector<const void *> out;
    for (const auto & [name, w] : model->tensors_by_name) {
        (void) name;
        if (w == nullptr || w->buffer == nullptr || !ggml_backend_buffer_is_host(w->buffer)) {
            continue;
        }
        const void * b = w->buffer;
        bool seen = false;
        for (const void * x : out) {
            seen = seen || x == b;
        }
        if (!seen) {
            out.push_back(b);
        }
    }
    return out;
}

}  // namespace

extern "C" int polykv_kq_model_choose(struct llama_model * model, int kernel) {
    const std::vector<const void *> bufs = weight_buffers(model);
    for (const void * b : bufs) {
        if (!polykv_kq_choose_buffer(b, kernel)) {
            for (const void * x : bufs) {
                polykv_kq_forget_buffer(x);
            }
            return 0;
        }
    }
    return 1;
}

extern "C" void polykv_kq_model_forget(struct llama_model * model) {
    for (const void * b : weight_buffers(model)) {
        polykv_kq_forget_buffer(b);
    }
}
