// qwen35mtp-testmodel writes a tiny random-weight Qwen3.5 model with one MTP (NextN) block
// (arch "qwen35", nextn_predict_layers = 1) for PolyKV's speculative-decoding tests:
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once. No small real model with MTP layers is at hand, and b11434's
// test-llama-archs writes its qwen35 model without them (nextn_predict_layers = 0), so its
// approach is followed here as in gemma4-testmodel.cpp: llama.cpp's model saver writes the
// metadata, llama_model_init_from_user (with load_mtp, or the NextN tensors are skipped)
// fills every tensor from a seeded normal distribution (the MTP head made to draft
// plausibly: see fill), and the saver writes the GGUF. The file is then loaded back, its trunk decoded, and llama.cpp's MTP context
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

#include "testmodel.h"

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

// The weight of h in the MTP head's eh_proj (see fill): its random part adds, per output,
// N(0, stdev·sqrt(2·n_embd)) ≈ N(0, 2.3) over unit-scale inputs, so the identity is
// made larger than that for the head's prediction to follow h more often than not.
const float eh_identity = 6.0f;

using testmodel::fill_params;

// fill draws each tensor's values from N(0, stdev) seeded by the tensor's name, as
// test-llama-archs does (ssm_a negated: the recurrent state must decay), except:
//  - the per-tensor quantization scales ("scale", "input_scale"), which llama.cpp creates
//    for every matrix when it builds a model without a file: they multiply a matmul's
//    output or input, so they are 1 rather than small numbers of either sign;
//  - the MTP head is made a plausible drafter rather than noise, so that drafts are
//    accepted often but not always and a driver's accept, partial-accept and reject paths
//    all run: hnorm and shared_head_norm are 1, eh_proj's half over the target's hidden
//    state h adds the identity, and the head's LM head (shared_head_head) is a copy of the
//    model's (output.weight). The block's attention and FFN stay random and add a smaller
//    random term, so the head outputs roughly the trunk's prediction from h: for a draft
//    at position p+1 (h of position p, token x_{p+1}), "x_{p+1} again". Greedy output of a
//    random model repeats tokens in runs, where such drafts are right.
void fill(ggml_tensor * t, void * ud) {
    const fill_params & p = *static_cast<const fill_params *>(ud);
    const bool nextn = strstr(t->name, ".nextn.") != nullptr;
    const char * seed_name = nextn && strstr(t->name, "shared_head_head.weight") ? "output.weight" : t->name;
    std::mt19937 gen(p.seed ^ std::hash<std::string>{}(seed_name));
    std::normal_distribution<float> dis(0.0f, p.stdev);
    const char * dot = strrchr(t->name, '.');
    const bool ones = (dot != nullptr && (strcmp(dot, ".scale") == 0 || strcmp(dot, ".input_scale") == 0)) ||
                      (nextn && (strstr(t->name, "hnorm.weight") || strstr(t->name, "shared_head_norm.weight")));
    const bool neg = strstr(t->name, "ssm_a") != nullptr;
    const bool eh_proj = nextn && strstr(t->name, "eh_proj.weight") != nullptr;
    const int64_t n = ggml_nelements(t);
    std::vector<float> v(n);
    for (auto & x : v) {
        const float r = dis(gen);
        x = ones ? 1.0f : neg ? -fabsf(r) : r;
    }
    if (eh_proj) { // ne0 = 2·n_embd inputs ([enorm(embed(x)), hnorm(h)]), ne1 = n_embd outputs
        const int64_t n_in = t->ne[0], n_out = t->ne[1];
        for (int64_t j = 0; j < n_out; j++) {
            v[j * n_in + n_in / 2 + j] += eh_identity;
        }
    }
    testmodel::set_values("qwen35mtp-testmodel", t, v);
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

bool finite(const float * v, int n) {
    if (v == nullptr) {
        return false;
    }
    for (int j = 0; j < n; j++) {
        if (!std::isfinite(v[j])) {
            return false;
        }
    }
    return true;
}

const int n_check = 40; // tokens decoded by check

llama_token check_token(int i) { return 4 + (i * 37) % 120; }

// trunk loads path (with or without its MTP layers) and decodes n_check tokens in one
// sequence; it returns the model and context (nullptr on failure) and the last logits.
bool trunk(const char * path, bool load_mtp, llama_model ** mo, llama_context ** co, std::vector<float> & logits) {
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = testmodel::quiet;
    mp.load_mtp = load_mtp;
    llama_model * m = llama_model_load_from_file(path, mp);
    *mo = m;
    *co = nullptr;
    if (m == nullptr) {
        fprintf(stderr, "qwen35mtp-testmodel: %s does not load (load_mtp %d)\n", path, load_mtp);
        return false;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(m, "general.architecture", arch, sizeof(arch));
    // n_layer counts the trunk only; n_layer_nextn is what the file has, loaded or not.
    if (strcmp(arch, "qwen35") != 0 || llama_model_n_layer_nextn(m) != int32_t(n_nextn) ||
        llama_model_n_layer(m) != int32_t(n_trunk)) {
        fprintf(stderr, "qwen35mtp-testmodel: %s loads as '%s' with %d layers, %d NextN\n", path, arch,
                llama_model_n_layer(m), llama_model_n_layer_nextn(m));
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * c = llama_init_from_model(m, cp);
    *co = c;
    if (c == nullptr) {
        fprintf(stderr, "qwen35mtp-testmodel: no context on %s\n", path);
        return false;
    }
    if (load_mtp) {
        // what a draft-mtp driver sets on the target: h_nextn for every token in a batch
        llama_set_embeddings_nextn(c, true, /*masked*/ false);
    }
    llama_batch b = llama_batch_init(n_check, 0, 1);
    for (int i = 0; i < n_check; i++) {
        b.token[i] = check_token(i);
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = i == n_check - 1;
    }
    b.n_tokens = n_check;
    const int n_vocab_m = llama_vocab_n_tokens(llama_model_get_vocab(m));
    bool ok = llama_decode(c, b) == 0 && finite(llama_get_logits_ith(c, n_check - 1), n_vocab_m);
    llama_batch_free(b);
    if (!ok) {
        fprintf(stderr, "qwen35mtp-testmodel: the trunk of %s does not decode (load_mtp %d)\n", path, load_mtp);
        return false;
    }
    const float * l = llama_get_logits_ith(c, n_check - 1);
    logits.assign(l, l + n_vocab_m);
    return true;
}

// check makes sure that path is a model both a plain user and a draft-mtp driver can run:
//  - loaded without load_mtp (PolyKV's load, llama-server without draft-mtp) it decodes
//    n_check tokens with finite logits;
//  - loaded with load_mtp it reports n_layer_nextn = 1 and gives the same logits bit for
//    bit (the NextN block is not part of the trunk's graph), and an NextN embedding
//    (h_nextn) for every token;
//  - an MTP context (LLAMA_CONTEXT_TYPE_MTP) on the same model decodes the same tokens,
//    each paired with the trunk's h of the token before it (the catch-up that
//    common_speculative_impl_draft_mtp::process does), then one draft step (the last
//    token again with the last h), with finite logits and a finite h row.
bool check(const char * path) {
    llama_model * m0 = nullptr;
    llama_context * c0 = nullptr;
    std::vector<float> l0, l1;
    bool ok = trunk(path, false, &m0, &c0, l0);
    llama_free(c0);
    llama_model_free(m0);
    if (!ok) {
        return false;
    }
    llama_model * m = nullptr;
    llama_context * c = nullptr;
    ok = trunk(path, true, &m, &c, l1);
    if (ok && l0 != l1) {
        fprintf(stderr, "qwen35mtp-testmodel: %s gives other logits when its MTP layers are loaded\n", path);
        ok = false;
    }
    std::vector<float> h; // the trunk's NextN rows, n_check × n_embd
    for (int i = 0; ok && i < n_check; i++) {
        const float * r = llama_get_embeddings_nextn_ith(c, i);
        ok = finite(r, n_embd);
        if (ok) {
            h.insert(h.end(), r, r + n_embd);
        } else {
            fprintf(stderr, "qwen35mtp-testmodel: no NextN row %d from the trunk of %s\n", i, path);
        }
    }
    llama_context * d = nullptr;
    if (ok) {
        llama_context_params dp = llama_context_default_params();
        dp.n_ctx = 256;
        dp.n_threads = dp.n_threads_batch = 2;
        dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        dp.ctx_other = c;
        d = llama_init_from_model(m, dp);
        ok = d != nullptr;
        if (!ok) {
            fprintf(stderr, "qwen35mtp-testmodel: no MTP context on %s\n", path);
        }
    }
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
        for (int i = 0; i < n_check; i++) {
            ok = ok && add(check_token(i), i, i == 0 ? zero.data() : h.data() + size_t(i - 1) * n_embd, false);
        }
        ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
        llama_batch_ext_clear(e);
        ok = ok && add(check_token(n_check - 1), n_check, h.data() + size_t(n_check - 1) * n_embd, true);
        ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
        ok = ok && finite(llama_get_logits_ith(d, 0), int(l1.size())) &&
             finite(llama_get_embeddings_nextn_ith(d, 0), n_embd);
        llama_batch_ext_free(e);
        if (!ok) {
            fprintf(stderr, "qwen35mtp-testmodel: the MTP context on %s does not decode\n", path);
        }
    }
    llama_free(d);
    llama_free(c);
    llama_model_free(m);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    testmodel::program p = {"qwen35mtp-testmodel", metadata, fill,
        [](llama_model_params & mp) {
            mp.load_mtp = true; // without it the loader skips the NextN block's tensors
        },
        [](llama_model * m, const std::string & out) {
            llama_model_saver ms(m);
            ms.add_kv_from_model();
            // The saver writes per-layer arrays for the trunk's layers only (n_layer()), but
            // the qwen35 loader reads recurrent_layers for all of them, NextN blocks included:
            // it is written again here with one entry per block (the MTP block is not
            // recurrent).
            const auto & hp = m->hparams;
            std::vector<uint32_t> recr(hp.is_recr_impl.begin(), hp.is_recr_impl.begin() + hp.n_layer_all);
            gguf_set_arr_data(ms.gguf_ctx, ms.llm_kv(LLM_KV_ATTENTION_RECURRENT_LAYERS).c_str(),
                              GGUF_TYPE_UINT32, recr.data(), recr.size());
            // Nor are the MTP block's per-matrix scales written: without load_mtp the qwen35
            // loader skips the block's matrices and then never asks for their scales, so a
            // file that has them fails to load ("wrong number of tensors") for every user
            // that does not draft with MTP. Real Qwen3.5 conversions have none.
            auto & mtp = m->layers[n_trunk];
            ggml_tensor ** tp = reinterpret_cast<ggml_tensor **>(&mtp);
            for (size_t i = 0; i < sizeof(mtp) / sizeof(ggml_tensor *); i++) {
                const char * dot = tp[i] != nullptr ? strrchr(tp[i]->name, '.') : nullptr;
                if (dot != nullptr && (strcmp(dot, ".scale") == 0 || strcmp(dot, ".input_scale") == 0)) {
                    tp[i] = nullptr;
                }
            }
            ms.add_tensors_from_model();
            ms.save(out);
        },
        check};
    return testmodel::run(p, argc, argv);
}
