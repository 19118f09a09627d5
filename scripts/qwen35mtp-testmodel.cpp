// qwen35mtp-testmodel writes a tiny random-weight Qwen3.5 model with one MTP (NextN) block
// (arch "qwen35", nextn_predict_layers = 1) for PolyKV's speculative-decoding tests:
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once. No small real model with MTP layers is at hand, and b11434's
// test-llama-archs writes its qwen35 model without them (nextn_predict_layers = 0), so its
// approach is followed here as in gemma4-testmodel.cpp: llama.cpp's model saver writes the
// metadata, llama_model_init_from_user (with load_mtp, or the NextN tensors are skipped)
// fills every tensor from a seeded normal distribution, llama_model_save_to_file writes the
// GGUF. The file is then loaded back, its trunk decoded, and llama.cpp's MTP context
// (LLAMA_CONTEXT_TYPE_MTP) created on it and run for one draft step fed by the trunk's
// NextN embeddings, so that a model llama.cpp cannot draft with is never left behind.
//
// The trunk is test-llama-archs' qwen35 fixture (~/.cache/polykv/testmodels/qwen35.gguf):
// 128-token vocabulary, n_embd 256, 2 heads of 128 (gated attention with q/k norms),
// n_ff 384, one gated-delta-net (recurrent) layer then one full-attention layer
// (full_attention_interval 2), SSM inner 256 / state 128 / 2 groups / conv 4. A third
// block is the MTP head, laid out as in Qwen3.5's checkpoints: a full-attention decoder
// block plus eh_proj (2·n_embd → n_embd over [enorm(embed(x)), hnorm(h)]), enorm, hnorm,
// and its own embed_tokens / shared_head_norm / shared_head_head (optional in the loader,
// written here so that the draft graph reads every tensor it can). The training context is
// 4096 (the fixture's is 256) so tests can run longer sequences.
//
// Usage: qwen35mtp-testmodel OUT.gguf [SEED]

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

// llama.cpp's internal headers, as test-llama-archs includes them: the model saver, the
// architecture's key names and the staging API for NextN embeddings are not public.
#include "llama-arch.h"
#include "llama-ext.h"
#include "llama-model-saver.h"
#include "llama-model.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 256, n_head = 2, n_head_kv = 2, head_dim = 128, n_ff = 384;
const uint32_t n_trunk = 2, n_nextn = 1;

struct fill_params {
    unsigned long seed;
    float         stdev;
};

// fill draws each tensor's values from N(0, stdev) seeded by the tensor's name, as
// test-llama-archs does (ssm_a negated: the recurrent state must decay), except the
// per-tensor quantization scales ("scale", "input_scale"), which llama.cpp creates for
// every matrix when it builds a model without a file: they multiply a matmul's output or
// input, so they are set to 1 rather than to small numbers of either sign.
void fill(ggml_tensor * t, void * ud) {
    const fill_params & p = *static_cast<const fill_params *>(ud);
    std::mt19937 gen(p.seed ^ std::hash<std::string>{}(t->name));
    std::normal_distribution<float> dis(0.0f, p.stdev);
    const char * dot = strrchr(t->name, '.');
    const bool ones = dot != nullptr && (strcmp(dot, ".scale") == 0 || strcmp(dot, ".input_scale") == 0);
    const bool neg = strstr(t->name, "ssm_a") != nullptr;
    const int64_t n = ggml_nelements(t);
    auto val = [&]() {
        const float v = dis(gen);
        return ones ? 1.0f : neg ? -fabsf(v) : v;
    };
    if (t->type == GGML_TYPE_F32) {
        std::vector<float> v(n);
        for (auto & x : v) {
            x = val();
        }
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    } else if (t->type == GGML_TYPE_F16) {
        std::vector<ggml_fp16_t> v(n);
        for (auto & x : v) {
            x = ggml_fp32_to_fp16(val());
        }
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    } else {
        fprintf(stderr, "qwen35mtp-testmodel: tensor %s has unexpected type %s\n", t->name, ggml_type_name(t->type));
        abort();
    }
}

gguf_context * metadata() {
    gguf_context * g = gguf_init_empty();
    llama_model_saver ms(LLM_ARCH_QWEN35, g);

    ms.add_kv(LLM_KV_GENERAL_ARCHITECTURE, llm_arch_name(LLM_ARCH_QWEN35));
    ms.add_kv(LLM_KV_VOCAB_SIZE, n_vocab);
    ms.add_kv(LLM_KV_CONTEXT_LENGTH, uint32_t(4096));
    ms.add_kv(LLM_KV_EMBEDDING_LENGTH, n_embd);
    // block_count counts the NextN blocks too: they are stored after the trunk's.
    ms.add_kv(LLM_KV_BLOCK_COUNT, n_trunk + n_nextn);
    ms.add_kv(LLM_KV_NEXTN_PREDICT_LAYERS, n_nextn);
    ms.add_kv(LLM_KV_FEED_FORWARD_LENGTH, n_ff);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT, n_head);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT_KV, n_head_kv);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, 1e-5f);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, head_dim);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_SECTIONS, std::vector<uint32_t>{32, 32, 32, 32});
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 10000.0f);
    // Layer 0 recurrent (gated delta net), layer 1 full attention; the MTP block (layer 2)
    // is attention-only, which the loader's default (recurrent only below n_layer()) gives.
    ms.add_kv(LLM_KV_FULL_ATTENTION_INTERVAL, uint32_t(2));
    ms.add_kv(LLM_KV_SSM_INNER_SIZE, uint32_t(256));
    ms.add_kv(LLM_KV_SSM_CONV_KERNEL, uint32_t(4));
    ms.add_kv(LLM_KV_SSM_STATE_SIZE, uint32_t(128));
    ms.add_kv(LLM_KV_SSM_TIME_STEP_RANK, n_head);
    ms.add_kv(LLM_KV_SSM_GROUP_COUNT, uint32_t(2));

    // llama.cpp's test tokenizer: ids are tok_<i>, no special tokens.
    std::vector<std::string> toks(n_vocab);
    for (uint32_t i = 0; i < n_vocab; i++) {
        toks[i] = "tok_" + std::to_string(i);
    }
    ms.add_kv(LLM_KV_TOKENIZER_MODEL, "test");
    ms.add_kv(LLM_KV_TOKENIZER_LIST, toks);
    ms.add_kv(LLM_KV_TOKENIZER_SCORES, std::vector<float>(n_vocab, 0.0f));
    return g;
}

bool quiet(float, void *) { return true; }

// check loads path as a file with its MTP layers and checks what a draft-mtp driver needs:
// n_layer_nextn = 1; the trunk decodes 40 tokens with finite logits and gives a NextN
// embedding (h_nextn) for each of them; an MTP context (LLAMA_CONTEXT_TYPE_MTP) is created on
// the same model and decodes the same 40 tokens, each paired with the trunk's h of the
// token before it (the catch-up common_speculative_impl_draft_mtp::process does), and then
// one draft step (the last token with the last h), with finite logits and a finite h row.
bool check(const char * path) {
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet;
    mp.load_mtp = true;
    llama_model * m = llama_model_load_from_file(path, mp);
    if (m == nullptr) {
        fprintf(stderr, "qwen35mtp-testmodel: %s does not load\n", path);
        return false;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(m, "general.architecture", arch, sizeof(arch));
    bool ok = strcmp(arch, "qwen35") == 0 && llama_model_n_layer_nextn(m) == int32_t(n_nextn) &&
              llama_model_n_layer(m) == int32_t(n_trunk); // n_layer counts the trunk only
    if (!ok) {
        fprintf(stderr, "qwen35mtp-testmodel: %s loads as '%s' with %d layers, %d NextN\n", path, arch,
                llama_model_n_layer(m), llama_model_n_layer_nextn(m));
    }
    const int n_vocab_m = llama_vocab_n_tokens(llama_model_get_vocab(m));
    auto finite = [](const float * v, int n) {
        if (v == nullptr) {
            return false;
        }
        for (int j = 0; j < n; j++) {
            if (!std::isfinite(v[j])) {
                return false;
            }
        }
        return true;
    };

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * c = ok ? llama_init_from_model(m, cp) : nullptr;
    llama_context_params dp = cp;
    dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    dp.ctx_other = c;
    llama_context * d = c != nullptr ? llama_init_from_model(m, dp) : nullptr;
    ok = ok && c != nullptr && d != nullptr;
    if (!ok) {
        fprintf(stderr, "qwen35mtp-testmodel: no %s context on %s\n", c == nullptr ? "main" : "MTP", path);
    }
    const int n = 40;
    std::vector<float> h; // the trunk's NextN rows, n × n_embd
    if (ok) {
        llama_set_embeddings_nextn(c, true, /*masked*/ false);
        llama_batch b = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            b.token[i] = 4 + (i * 37) % 120;
            b.pos[i] = i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = i == n - 1;
        }
        b.n_tokens = n;
        ok = llama_decode(c, b) == 0 && finite(llama_get_logits_ith(c, n - 1), n_vocab_m);
        for (int i = 0; ok && i < n; i++) {
            const float * r = llama_get_embeddings_nextn_ith(c, i);
            ok = finite(r, n_embd);
            if (ok) {
                h.insert(h.end(), r, r + n_embd);
            }
        }
        if (!ok) {
            fprintf(stderr, "qwen35mtp-testmodel: the trunk of %s does not decode or gives no NextN rows\n", path);
        }

        // The MTP context: token i with h of token i-1 (zeros for the first), then the draft step.
        if (ok) {
            llama_set_embeddings_nextn(d, true, /*masked*/ true);
            llama_batch_ext * e = llama_batch_ext_init(d);
            const std::vector<float> zero(n_embd, 0.0f);
            // One entry: token id, position, and h as the entry's embedding. b11434's
            // llama_batch_ext_set_embd_state is a stub (returns false); the MTP graph reads h
            // from the token's embedding, as common_batch::set_embd passes it.
            auto add = [&](llama_token tok, llama_pos pos, const float * row, bool out) {
                const int32_t idx = llama_batch_ext_add_token(e, 0, tok);
                return idx >= 0 && llama_batch_ext_set_pos(e, idx, &pos) &&
                       llama_batch_ext_set_embd_token(e, idx, {row, 1, n_embd}) &&
                       (!out || llama_batch_ext_set_output_logits(e, idx, true));
            };
            for (int i = 0; i < n; i++) {
                ok = ok && add(b.token[i], i, i == 0 ? zero.data() : h.data() + size_t(i - 1) * n_embd, false);
            }
            ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
            llama_batch_ext_clear(e);
            ok = ok && add(7, n, h.data() + size_t(n - 1) * n_embd, true);
            ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
            ok = ok && finite(llama_get_logits_ith(d, 0), n_vocab_m) && finite(llama_get_embeddings_nextn_ith(d, 0), n_embd);
            llama_batch_ext_free(e);
            if (!ok) {
                fprintf(stderr, "qwen35mtp-testmodel: the MTP context on %s does not decode\n", path);
            }
        }
        llama_batch_free(b);
    }
    llama_free(d);
    llama_free(c);
    llama_model_free(m);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s OUT.gguf [SEED]\n", argv[0]);
        return 2;
    }
    const std::string out = argv[1];
    fill_params fp = {argc == 3 ? strtoul(argv[2], nullptr, 10) : 42ul, 0.1f};
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            fputs(text, stderr);
        }
    }, nullptr);

    gguf_context * g = metadata();
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet;
    mp.load_mtp = true; // without it the loader skips the NextN block's tensors
    llama_model * m = llama_model_init_from_user(g, fill, &fp, mp);
    if (m == nullptr) {
        fprintf(stderr, "qwen35mtp-testmodel: llama.cpp refused the model's metadata\n");
        return 1;
    }
    {
        llama_model_saver ms(m);
        ms.add_kv_from_model();
        // The saver writes per-layer arrays for the trunk's layers only (n_layer()), but the
        // qwen35 loader reads recurrent_layers for all of them, NextN blocks included: it is
        // written again here with one entry per block (the MTP block is not recurrent).
        const auto & hp = m->hparams;
        std::vector<uint32_t> recr(hp.is_recr_impl.begin(), hp.is_recr_impl.begin() + hp.n_layer_all);
        gguf_set_arr_data(ms.gguf_ctx, ms.llm_kv(LLM_KV_ATTENTION_RECURRENT_LAYERS).c_str(),
                          GGUF_TYPE_UINT32, recr.data(), recr.size());
        ms.add_tensors_from_model();
        ms.save(out);
    }
    llama_model_free(m);
    gguf_free(g);
    if (!check(out.c_str())) {
        remove(out.c_str());
        return 1;
    }
    llama_backend_free();
    return 0;
}
