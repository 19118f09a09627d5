// gemma4-testmodel writes a tiny random-weight Gemma 4 model (arch "gemma4") for PolyKV's
// tests: `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static
// libraries and runs it once. llama.cpp's own test-llama-archs, which writes the other
// architectures' test models, skips gemma4 in build 11434 ("ISWA KV cache initialization
// needs more fixture params"): its fixture gives the sliding-window pattern as a scalar
// period, which Gemma 4's loader reads as a per-layer array. This program follows that
// tool's approach (llama_model_init_from_user builds the model from the metadata and fills
// every tensor from a seeded normal distribution) with Gemma 4's parameters given in full,
// writes the GGUF from the metadata and the tensors fill wrote (testmodel.h, public API
// only), then loads the file back and decodes a few tokens so that a model llama.cpp
// cannot run is never left behind.
//
// The layout is Gemma 4's (E2B/E4B in miniature): 10 layers of interleaved sliding-window
// attention (four sliding layers, then one full layer), a different head size on the
// sliding and the full layers, the last 5 layers sharing earlier layers' KV, per-layer
// embeddings, q/k norms, proportional RoPE factors on the full layers and a final logit
// soft-cap. The window is small (32 positions) so that test prompts of a few
// hundred tokens go well past it.
//
// Usage: gemma4-testmodel OUT.gguf [SEED]

#include "gemma4testmodel.h"
#include "testmodel.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

const uint32_t per_layer_embd   = 32; // Gemma 4's per-layer embeddings (E2B/E4B), a quarter of n_embd here
const uint32_t shared_kv_layers = 5;  // layers 5..9 reuse layers 3 and 4's KV (E2B/E4B)

using testmodel::fill_params;

// fill draws each tensor's values from N(0, stdev) seeded by the tensor's name, as
// test-llama-archs does, except the full layers' RoPE frequency factors: they divide the
// rotation frequencies, so they are set to 1 (plain RoPE) rather than to values near 0.
void fill(ggml_tensor * t, void * ud) {
    const fill_params & p = *static_cast<const fill_params *>(ud);
    std::mt19937 gen(p.seed ^ std::hash<std::string>{}(t->name));
    std::normal_distribution<float> dis(0.0f, p.stdev);
    const bool ones = strstr(t->name, "rope_freqs") != nullptr;
    std::vector<float> v(ggml_nelements(t));
    for (auto & x : v) {
        x = ones ? 1.0f : dis(gen);
    }
    testmodel::set_values("gemma4-testmodel", t, v);
}

gguf_context * metadata() {
    const testmodel::keys k = testmodel::keys::begin("gemma4");

    const uint32_t n_vocab = 128, n_ctx = 4096, n_embd = 128, n_head = 2, n_ff = 192, n_layer = 10;

    k.u32("vocab_size", n_vocab);
    k.u32("context_length", n_ctx);
    k.u32("embedding_length", n_embd);
    k.u32("block_count", n_layer);
    k.u32("feed_forward_length", n_ff);
    gemma4test::add_attention_kv(k, n_head);
    // Per layer, 1 = sliding window: the pattern Gemma 4 repeats (four sliding, one full).
    k.u32s("attention.sliding_window_pattern", {1, 1, 1, 1, 0, 1, 1, 1, 1, 0});
    // The last shared_kv_layers layers keep no KV of their own: they read the last sliding
    // and the last full layer's before them (layers 3 and 4), as E2B's last 20 of 35 do.
    k.u32("attention.shared_kv_layers", shared_kv_layers);
    k.u32("embedding_length_per_layer_input", per_layer_embd);
    k.f32("final_logit_softcapping", 30.0f);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

// check loads path as a file and decodes 80 tokens (past the 32-position window) in one
// sequence: the model must load as gemma4 and give finite logits.
bool check(const char * path) {
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = testmodel::quiet;
    llama_model * m = llama_model_load_from_file(path, mp);
    if (m == nullptr) {
        fprintf(stderr, "gemma4-testmodel: %s does not load\n", path);
        return false;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(m, "general.architecture", arch, sizeof(arch));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * c = llama_init_from_model(m, cp);
    bool ok = c != nullptr && strcmp(arch, "gemma4") == 0;
    if (ok) {
        const int n = 80;
        llama_batch b = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            b.token[i] = 4 + (i * 37) % 120;
            b.pos[i] = i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = i == n - 1;
        }
        b.n_tokens = n;
        ok = llama_decode(c, b) == 0;
        if (ok) {
            const float * l = llama_get_logits_ith(c, n - 1);
            for (int j = 0; j < llama_vocab_n_tokens(llama_model_get_vocab(m)); j++) {
                ok = ok && std::isfinite(l[j]);
            }
        }
        llama_batch_free(b);
    }
    if (!ok) {
        fprintf(stderr, "gemma4-testmodel: %s (arch '%s') does not decode\n", path, arch);
    }
    llama_free(c);
    llama_model_free(m);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    // The file is the metadata and every tensor fill wrote, the two model-wide per-layer
    // embedding projections included (b11434's model saver, which wrote the file before,
    // left those and the per-layer embedding keys out).
    testmodel::program p = {"gemma4-testmodel", metadata, fill, nullptr, nullptr, check};
    return testmodel::run(p, argc, argv);
}
