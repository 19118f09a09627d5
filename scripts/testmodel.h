// testmodel.h: what the test-model generators (scripts/*-testmodel.cpp) share: writing
// metadata keys, writing a tensor's values, and main's sequence (llama.cpp builds the model
// from the program's metadata with fill giving every tensor's values, the program keeps a
// copy of each tensor fill wrote and writes the GGUF itself, the file is loaded back and
// decoded by the program's check before it is kept). Each program gives its own metadata,
// fill, edit and check; scripts/llama.sh testmodels compiles them.
//
// Only llama.cpp's public headers are used here (llama.h, ggml.h, ggml-backend.h,
// gguf.h): the generators once went through its private model saver and key tables
// (llama-model-saver.h, llama-arch.h), which made every llama.cpp bump an audit of them
// too. Keys are written by their GGUF names, and the file is written from what fill saw
// rather than from llama.cpp's model structures. internal/llama's
// TestInternalsOnlyIncluder keeps it so.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace testmodel {

// keys writes metadata keys into g: the architecture's own ("<arch>.block_count") through
// the arch_* calls, the others by their full names. The order of the calls is the order
// in the file.
struct keys {
    gguf_context * g;
    std::string    arch;

    // begin makes an empty context with general.architecture set to arch.
    static keys begin(const char * arch) {
        keys k{gguf_init_empty(), arch};
        gguf_set_val_str(k.g, "general.architecture", arch);
        return k;
    }

    std::string name(const char * key) const { return arch + "." + key; }

    void u32(const char * key, uint32_t v) const { gguf_set_val_u32(g, name(key).c_str(), v); }
    void f32(const char * key, float v) const { gguf_set_val_f32(g, name(key).c_str(), v); }
    void flag(const char * key, bool v) const { gguf_set_val_bool(g, name(key).c_str(), v); }
    void u32s(const char * key, const std::vector<uint32_t> & v) const {
        gguf_set_arr_data(g, name(key).c_str(), GGUF_TYPE_UINT32, v.data(), v.size());
    }
};

// add_test_tokenizer writes llama.cpp's test tokenizer, as test-llama-archs does: ids are
// tok_<i>, no special tokens.
inline void add_test_tokenizer(const keys & k, uint32_t n_vocab) {
    std::vector<std::string> toks(n_vocab);
    std::vector<const char *> ptrs(n_vocab);
    for (uint32_t i = 0; i < n_vocab; i++) {
        toks[i] = "tok_" + std::to_string(i);
        ptrs[i] = toks[i].c_str();
    }
    const std::vector<float> scores(n_vocab, 0.0f);
    gguf_set_val_str(k.g, "tokenizer.ggml.model", "test");
    gguf_set_arr_str(k.g, "tokenizer.ggml.tokens", ptrs.data(), ptrs.size());
    gguf_set_arr_data(k.g, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores.data(), scores.size());
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

// tensor is one tensor of the file to be written: what fill was given (name, type, shape)
// and the bytes it wrote.
struct tensor {
    std::string          name;
    ggml_type            type;
    int                  n_dims;
    int64_t              ne[GGML_MAX_DIMS];
    std::vector<uint8_t> data;
};

// tensors is the file's tensors, in the order llama.cpp created them.
struct tensors {
    std::vector<tensor> list;

    // find is the tensor called name, or nullptr.
    tensor * find(const std::string & name) {
        for (auto & t : list) {
            if (t.name == name) {
                return &t;
            }
        }
        return nullptr;
    }

    // at is the tensor called name; there must be one (a generator's edit names tensors
    // llama.cpp's builder made, so a missing one is a bug there, and aborts).
    tensor & at(const std::string & name) {
        tensor * t = find(name);
        if (t == nullptr) {
            fprintf(stderr, "testmodel: llama.cpp made no tensor %s\n", name.c_str());
            abort();
        }
        return *t;
    }

    // remove drops the tensor called name, if there is one.
    void remove(const std::string & name) {
        for (size_t i = 0; i < list.size(); i++) {
            if (list[i].name == name) {
                list.erase(list.begin() + long(i));
                return;
            }
        }
    }
};

// write writes metadata's keys and ts to path as a GGUF file.
inline bool write(const char * prog, const gguf_context * metadata, const tensors & ts, const std::string & path) {
    gguf_context * g = gguf_init_empty();
    gguf_set_kv(g, metadata);
    // The tensors' descriptions only: gguf reads each one's data from the copy in ts.
    ggml_init_params ip = {ts.list.size() * ggml_tensor_overhead() + 1024, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    for (const auto & t : ts.list) {
        ggml_tensor * d = ggml_new_tensor(ctx, t.type, t.n_dims, t.ne);
        ggml_set_name(d, t.name.c_str());
        if (ggml_nbytes(d) != t.data.size()) {
            fprintf(stderr, "%s: tensor %s has %zu bytes for %zu\n", prog, t.name.c_str(), t.data.size(), ggml_nbytes(d));
            abort();
        }
        gguf_add_tensor(g, d);
        gguf_set_tensor_data(g, t.name.c_str(), t.data.data());
    }
    const bool ok = gguf_write_to_file(g, path.c_str(), false);
    if (!ok) {
        fprintf(stderr, "%s: cannot write %s\n", prog, path.c_str());
    }
    ggml_free(ctx);
    gguf_free(g);
    return ok;
}

// program is one generator: its name (for messages), its metadata, its fill, extra model
// parameters, an edit of the tensors before they are written (may be null) and how it
// checks the written file.
struct program {
    const char * name;
    gguf_context * (*metadata)();
    void (*fill)(ggml_tensor *, void *);
    void (*params)(llama_model_params &);
    void (*edit)(tensors &);
    bool (*check)(const char *);
};

// recording is the fill run() gives llama.cpp: the program's fill, then a copy of what it
// wrote. A tensor llama.cpp places twice under one name (a tied or shared tensor) is kept
// once: fill, seeded by the name, writes the same values to both.
struct recording {
    const program * p;
    fill_params     fp;
    tensors         ts;
};

inline void record(ggml_tensor * t, void * ud) {
    recording & r = *static_cast<recording *>(ud);
    r.p->fill(t, &r.fp);
    if (r.ts.find(t->name) != nullptr) {
        return;
    }
    tensor c{t->name, t->type, ggml_n_dims(t), {}, std::vector<uint8_t>(ggml_nbytes(t))};
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        c.ne[i] = t->ne[i];
    }
    ggml_backend_tensor_get(t, c.data.data(), 0, c.data.size());
    r.ts.list.push_back(std::move(c));
}

// run is main: usage `PROG OUT.gguf [SEED]` (seed 42 by default, stdev 0.1); the file is
// removed again if check fails, so a model llama.cpp cannot run is never left behind.
inline int run(const program & p, int argc, char ** argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s OUT.gguf [SEED]\n", argv[0]);
        return 2;
    }
    const std::string out = argv[1];
    recording r{&p, {argc == 3 ? strtoul(argv[2], nullptr, 10) : 42ul, 0.1f}, {}};
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
    llama_model * m = llama_model_init_from_user(g, record, &r, mp);
    if (m == nullptr) {
        fprintf(stderr, "%s: llama.cpp refused the model's metadata\n", p.name);
        return 1;
    }
    llama_model_free(m);
    if (p.edit != nullptr) {
        p.edit(r.ts);
    }
    const bool written = write(p.name, g, r.ts, out);
    gguf_free(g);
    if (!written || !p.check(out.c_str())) {
        remove(out.c_str());
        return 1;
    }
    llama_backend_free();
    return 0;
}

} // namespace testmodel
