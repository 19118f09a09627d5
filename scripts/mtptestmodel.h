// mtptestmodel.h: what the MTP test-model generators (scripts/qwen35mtp-testmodel.cpp,
// scripts/glm4moemtp-testmodel.cpp) share beyond testmodel.h: the fill that makes the NextN
// head a plausible drafter, the save that leaves the per-matrix scales off the NextN block,
// and the check that a written file loads with and without its MTP layers, gives the same
// trunk logits either way and drafts in llama.cpp's MTP context. Each generator gives its
// metadata (arch, trunk) and, where its loader needs it, a fix-up before saving.
#pragma once

#include "testmodel.h"

// llama.cpp's internal headers, as test-llama-archs includes them: the model saver, the
// architecture's key names and the staging API for NextN embeddings are not public.
#include "llama-arch.h"
#include "llama-ext.h"
#include "llama-model-saver.h"
#include "llama-model.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace testmodel {

// mtp_model_params loads the NextN block's tensors: without load_mtp the loader skips them.
inline void mtp_model_params(llama_model_params & mp) { mp.load_mtp = true; }

// mtp_model is what the shared save and check need to know of a generator's model.
struct mtp_model {
    const char * prog;    // for messages
    const char * arch;    // general.architecture
    int32_t      n_trunk; // llama_model_n_layer: the trunk's blocks
    int32_t      n_nextn; // llama_model_n_layer_nextn: NextN blocks stored after the trunk's
    int32_t      n_embd;  // width of a NextN row (h)
};

// mtp_add_base_kv writes the keys every MTP generator's metadata opens with, in this order
// (the order is part of the file's bytes): architecture, vocabulary, context length,
// width and the block counts. block_count counts the NextN blocks too: they are stored
// after the trunk's.
inline void mtp_add_base_kv(llama_model_saver & ms, llm_arch arch, uint32_t n_vocab, uint32_t n_embd,
                            uint32_t n_trunk, uint32_t n_nextn) {
    ms.add_kv(LLM_KV_GENERAL_ARCHITECTURE, llm_arch_name(arch));
    ms.add_kv(LLM_KV_VOCAB_SIZE, n_vocab);
    ms.add_kv(LLM_KV_CONTEXT_LENGTH, uint32_t(4096));
    ms.add_kv(LLM_KV_EMBEDDING_LENGTH, n_embd);
    ms.add_kv(LLM_KV_BLOCK_COUNT, n_trunk + n_nextn);
    ms.add_kv(LLM_KV_NEXTN_PREDICT_LAYERS, n_nextn);
}

// mtp_add_moe_kv writes the MoE keys the MoE generators (glm4moe, deepseek2) share, in this
// order (part of the file's bytes): one leading dense block of n_ff, then MoE blocks of 2
// experts of n_ff, both used, one shared expert, sigmoid gating (GLM-4.5's and DeepSeek V3's).
inline void mtp_add_moe_kv(llama_model_saver & ms, uint32_t n_ff) {
    ms.add_kv(LLM_KV_LEADING_DENSE_BLOCK_COUNT, uint32_t(1));
    ms.add_kv(LLM_KV_FEED_FORWARD_LENGTH, n_ff);
    ms.add_kv(LLM_KV_EXPERT_FEED_FORWARD_LENGTH, n_ff);
    ms.add_kv(LLM_KV_EXPERT_COUNT, uint32_t(2));
    ms.add_kv(LLM_KV_EXPERT_USED_COUNT, uint32_t(2));
    ms.add_kv(LLM_KV_EXPERT_SHARED_COUNT, uint32_t(1));
    ms.add_kv(LLM_KV_EXPERT_GATING_FUNC, uint32_t(2)); // sigmoid
}

// mtp_add_attn_kv writes the attention head keys of the generators with plain
// multi-head attention (glm4moe, cohere2moe), in this order (part of the file's bytes).
inline void mtp_add_attn_kv(llama_model_saver & ms, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim) {
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT, n_head);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT_KV, n_head_kv);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH, head_dim);
}

// The weight of h in the MTP head's eh_proj (see mtp_fill): its random part adds, per output,
// N(0, stdev·sqrt(2·n_embd)) ≈ N(0, 2.3) over unit-scale inputs at n_embd 256, so the
// identity is made larger than that for the head's prediction to follow h more often than not.
const float mtp_eh_identity = 6.0f;

// mtp_fill draws each tensor's values from N(0, stdev) seeded by the tensor's name, as
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
inline void mtp_fill(ggml_tensor * t, void * ud) {
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
            v[j * n_in + n_in / 2 + j] += mtp_eh_identity;
        }
    }
    set_values("mtp-testmodel", t, v);
}

// mtp_drop_nextn_scales removes the per-matrix scales from the NextN blocks before saving:
// without load_mtp the loaders skip a NextN block's matrices and then never ask for their
// scales, so a file that has them fails to load ("wrong number of tensors") for every user
// that does not draft with MTP. Real conversions have none.
inline void mtp_drop_nextn_scales(llama_model * m, int32_t n_trunk) {
    for (uint32_t il = uint32_t(n_trunk); il < m->hparams.n_layer_all; il++) {
        auto & layer = m->layers[il];
        ggml_tensor ** tp = reinterpret_cast<ggml_tensor **>(&layer);
        for (size_t i = 0; i < sizeof(layer) / sizeof(ggml_tensor *); i++) {
            const char * dot = tp[i] != nullptr ? strrchr(tp[i]->name, '.') : nullptr;
            if (dot != nullptr && (strcmp(dot, ".scale") == 0 || strcmp(dot, ".input_scale") == 0)) {
                tp[i] = nullptr;
            }
        }
    }
}


const int mtp_n_check = 40; // tokens decoded by mtp_check

// How far the trunk's logits may move when the NextN rows of every token are asked for
// (see mtp_check): rounding, three orders of magnitude above what glm4moe shows.
const float mtp_nextn_tolerance = 1e-4f;

inline llama_token mtp_check_token(int i) { return 4 + (i * 37) % 120; }

// mtp_trunk loads path (with or without its MTP layers) and decodes mtp_n_check tokens in
// one sequence, with the NextN rows of every token asked for (nextn, what a draft-mtp driver
// sets on its target) or not; it returns the model and context (nullptr on failure) and the
// last logits.
inline bool mtp_trunk(const mtp_model & s, const char * path, bool load_mtp, bool nextn, llama_model ** mo,
                      llama_context ** co, std::vector<float> & logits) {
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet;
    mp.load_mtp = load_mtp;
    llama_model * m = llama_model_load_from_file(path, mp);
    *mo = m;
    *co = nullptr;
    if (m == nullptr) {
        fprintf(stderr, "%s: %s does not load (load_mtp %d)\n", s.prog, path, load_mtp);
        return false;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(m, "general.architecture", arch, sizeof(arch));
    // n_layer counts the trunk only; n_layer_nextn is what the file has, loaded or not.
    if (strcmp(arch, s.arch) != 0 || llama_model_n_layer_nextn(m) != s.n_nextn || llama_model_n_layer(m) != s.n_trunk) {
        fprintf(stderr, "%s: %s loads as '%s' with %d layers, %d NextN\n", s.prog, path, arch, llama_model_n_layer(m),
                llama_model_n_layer_nextn(m));
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * c = llama_init_from_model(m, cp);
    *co = c;
    if (c == nullptr) {
        fprintf(stderr, "%s: no context on %s\n", s.prog, path);
        return false;
    }
    if (nextn) {
        // h_nextn for every token in a batch
        llama_set_embeddings_nextn(c, true, /*masked*/ false);
    }
    llama_batch b = llama_batch_init(mtp_n_check, 0, 1);
    for (int i = 0; i < mtp_n_check; i++) {
        b.token[i] = mtp_check_token(i);
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = i == mtp_n_check - 1;
    }
    b.n_tokens = mtp_n_check;
    const int n_vocab_m = llama_vocab_n_tokens(llama_model_get_vocab(m));
    bool ok = llama_decode(c, b) == 0 && finite(llama_get_logits_ith(c, mtp_n_check - 1), n_vocab_m);
    llama_batch_free(b);
    if (!ok) {
        fprintf(stderr, "%s: the trunk of %s does not decode (load_mtp %d)\n", s.prog, path, load_mtp);
        return false;
    }
    const float * l = llama_get_logits_ith(c, mtp_n_check - 1);
    logits.assign(l, l + n_vocab_m);
    return true;
}

// mtp_check makes sure that path is a model both a plain user and a draft-mtp driver can run:
//  - loaded without load_mtp (PolyKV's load, llama-server without draft-mtp) it decodes
//    mtp_n_check tokens with finite logits;
//  - loaded with load_mtp it reports n_layer_nextn as written and gives the same logits bit
//    for bit (the NextN block is not part of the trunk's graph);
//  - asked for the NextN embedding (h_nextn) of every token, it gives one per token and the
//    same logits within mtp_nextn_tolerance: bit for bit on qwen35, but glm4moe's graph then
//    runs its last block's FFN over every row and picks the last after it (before it
//    otherwise), so the sums round differently (measured: 6e-8 at most);
//  - an MTP context (LLAMA_CONTEXT_TYPE_MTP) on the same model decodes the same tokens,
//    each paired with the trunk's h of the token before it (the catch-up that
//    common_speculative_impl_draft_mtp::process does), then one draft step (the last
//    token again with the last h), with finite logits and a finite h row.
inline bool mtp_check(const mtp_model & s, const char * path) {
    const int n_embd = s.n_embd;
    llama_model * m0 = nullptr;
    llama_context * c0 = nullptr;
    std::vector<float> l0, l1, l2;
    bool ok = mtp_trunk(s, path, false, false, &m0, &c0, l0);
    llama_free(c0);
    llama_model_free(m0);
    ok = ok && mtp_trunk(s, path, true, false, &m0, &c0, l1);
    llama_free(c0);
    llama_model_free(m0);
    if (ok && l0 != l1) {
        fprintf(stderr, "%s: %s gives other logits when its MTP layers are loaded\n", s.prog, path);
        ok = false;
    }
    if (!ok) {
        return false;
    }
    llama_model * m = nullptr;
    llama_context * c = nullptr;
    ok = mtp_trunk(s, path, true, true, &m, &c, l2);
    for (size_t i = 0; ok && i < l0.size(); i++) {
        if (fabsf(l2[i] - l0[i]) > mtp_nextn_tolerance) {
            fprintf(stderr, "%s: %s gives logit %zu %g with NextN rows, %g without\n", s.prog, path, i, l2[i], l0[i]);
            ok = false;
        }
    }
    std::vector<float> h; // the trunk's NextN rows, mtp_n_check × n_embd
    for (int i = 0; ok && i < mtp_n_check; i++) {
        const float * r = llama_get_embeddings_nextn_ith(c, i);
        ok = finite(r, n_embd);
        if (ok) {
            h.insert(h.end(), r, r + n_embd);
        } else {
            fprintf(stderr, "%s: no NextN row %d from the trunk of %s\n", s.prog, i, path);
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
            fprintf(stderr, "%s: no MTP context on %s\n", s.prog, path);
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
                   llama_batch_ext_set_embd_token(e, idx, {row, 1, size_t(n_embd)}) &&
                   (!out || llama_batch_ext_set_output_logits(e, idx, true));
        };
        for (int i = 0; i < mtp_n_check; i++) {
            ok = ok && add(mtp_check_token(i), i, i == 0 ? zero.data() : h.data() + size_t(i - 1) * n_embd, false);
        }
        ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
        llama_batch_ext_clear(e);
        ok = ok && add(mtp_check_token(mtp_n_check - 1), mtp_n_check, h.data() + size_t(mtp_n_check - 1) * n_embd, true);
        ok = ok && llama_process(d, LLAMA_PROCESS_TYPE_DECODE, e) == 0;
        ok = ok && finite(llama_get_logits_ith(d, 0), int(l2.size())) &&
             finite(llama_get_embeddings_nextn_ith(d, 0), n_embd);
        llama_batch_ext_free(e);
        if (!ok) {
            fprintf(stderr, "%s: the MTP context on %s does not decode\n", s.prog, path);
        }
    }
    llama_free(d);
    llama_free(c);
    llama_model_free(m);
    return ok;
}

// mtp_run is an MTP generator's main: the model of spec with metadata's keys, filled by
// mtp_fill with load_mtp on, saved with its keys from the model (fix, if not null, edits
// them first) and without the NextN blocks' scales (mtp_drop_nextn_scales), then checked
// (mtp_check). testmodel::program takes plain functions, so the generator's spec and fix
// reach them through these two variables.
inline const mtp_model * mtp_spec = nullptr;
inline void (*mtp_fix)(llama_model_saver &, llama_model *) = nullptr;

inline int mtp_run(const mtp_model & spec, gguf_context * (*metadata)(), void (*fix)(llama_model_saver &, llama_model *),
                   int argc, char ** argv) {
    mtp_spec = &spec;
    mtp_fix = fix;
    program p = {spec.prog, metadata, mtp_fill, mtp_model_params,
        [](llama_model * m, const std::string & out) {
            llama_model_saver ms(m);
            ms.add_kv_from_model();
            if (mtp_fix != nullptr) {
                mtp_fix(ms, m);
            }
            mtp_drop_nextn_scales(m, mtp_spec->n_trunk);
            ms.add_tensors_from_model();
            ms.save(out);
        },
        [](const char * path) { return mtp_check(*mtp_spec, path); }};
    return run(p, argc, argv);
}

} // namespace testmodel
