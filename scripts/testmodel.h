// testmodel.h: what scripts/gemma4-testmodel.cpp and scripts/qwen35mtp-testmodel.cpp
// share: writing a tensor's values, and main's sequence (llama.cpp builds the model from
// metadata with fill giving every tensor's values, the program saves it, the file is
// loaded back and decoded by the program's check before it is kept). Each program gives
// its own metadata, fill, save and check; scripts/llama.sh testmodels compiles them.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"
#include "llama-arch.h"
#include "llama-model-saver.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace testmodel {

// add_test_tokenizer writes llama.cpp's test tokenizer, as test-llama-archs does: ids are
// tok_<i>, no special tokens.
inline void add_test_tokenizer(llama_model_saver & ms, uint32_t n_vocab) {
    std::vector<std::string> toks(n_vocab);
    for (uint32_t i = 0; i < n_vocab; i++) {
        toks[i] = "tok_" + std::to_string(i);
    }
    ms.add_kv(LLM_KV_TOKENIZER_MODEL, "test");
    ms.add_kv(LLM_KV_TOKENIZER_LIST, toks);
    ms.add_kv(LLM_KV_TOKENIZER_SCORES, std::vector<float>(n_vocab, 0.0f));
}

// fill_params is fill's user data: the seed (mixed with each tensor's name) and the
// standard deviation of the random values.
struct fill_params {
    unsigned long seed;
    float         stdev;
};

// set_values writes v into t, converting to t's type (F32 or F16; anything else is a bug
// in the generator's metadata and aborts).
inline void set_values(const char * prog, ggml_tensor * t, const std::vector<float> & v) {
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    } else if (t->type == GGML_TYPE_F16) {
        std::vector<ggml_fp16_t> h(v.size());
        for (size_t i = 0; i < v.size(); i++) {
            h[i] = ggml_fp32_to_fp16(v[i]);
        }
        ggml_backend_tensor_set(t, h.data(), 0, ggml_nbytes(t));
    } else {
        fprintf(stderr, "%s: tensor %s has unexpected type %s\n", prog, t->name, ggml_type_name(t->type));
        abort();
    }
}

inline bool quiet(float, void *) { return true; }

// finite reports whether v holds n finite values (false for nullptr: llama.cpp gives none).
inline bool finite(const float * v, int n) {
    if (v == nullptr) {
        return false;
    }
    for (int i = 0; i < n; i++) {
        if (!std::isfinite(v[i])) {
            return false;
        }
    }
    return true;
}

// program is one generator: its name (for messages), its metadata, its fill, extra model
// parameters, how it saves the built model and how it checks the written file.
struct program {
    const char * name;
    gguf_context * (*metadata)();
    void (*fill)(ggml_tensor *, void *);
    void (*params)(llama_model_params &);
    void (*save)(llama_model *, const std::string &);
    bool (*check)(const char *);
};

// run is main: usage `PROG OUT.gguf [SEED]` (seed 42 by default, stdev 0.1); the file is
// removed again if check fails, so a model llama.cpp cannot run is never left behind.
inline int run(const program & p, int argc, char ** argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s OUT.gguf [SEED]\n", argv[0]);
        return 2;
    }
    const std::string out = argv[1];
    fill_params fp = {argc == 3 ? strtoul(argv[2], nullptr, 10) : 42ul, 0.1f};
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) { // warnings (e.g. a full-size SWA cache) are expected here
            fputs(text, stderr);
        }
    }, nullptr);

    gguf_context * g = p.metadata();
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet;
    if (p.params != nullptr) {
        p.params(mp);
    }
    llama_model * m = llama_model_init_from_user(g, p.fill, &fp, mp);
    if (m == nullptr) {
        fprintf(stderr, "%s: llama.cpp refused the model's metadata\n", p.name);
        return 1;
    }
    p.save(m, out);
    llama_model_free(m);
    gguf_free(g);
    if (!p.check(out.c_str())) {
        remove(out.c_str());
        return 1;
    }
    llama_backend_free();
    return 0;
}

} // namespace testmodel
