// mtptestmodel.h: what the MTP test-model generators (scripts/*mtp-testmodel.cpp) share
// beyond testmodel.h: the fill that makes the NextN head a plausible drafter, the edit
// that leaves the per-matrix scales off the NextN blocks, and the check that a written
// file loads with and without its MTP layers, gives the same trunk logits either way and
// drafts in llama.cpp's MTP context. Each generator gives its metadata (arch, trunk) and,
// where its loader needs it, an edit of the tensors before they are written.
#pragma once

#include "testmodel.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace testmodel {

// mtp_model_params loads the NextN block's tensors: without load_mtp the loader skips them.
inline void mtp_model_params(llama_model_params & mp) { mp.load_mtp = true; }

// mtp_model is what the shared edit and check need to know of a generator's model.
struct mtp_model {
    const char * prog;    // for messages
    const char * arch;    // general.architecture
    int32_t      n_trunk; // llama_model_n_layer: the trunk's blocks
    int32_t      n_nextn; // llama_model_n_layer_nextn: NextN blocks stored after the trunk's
    int32_t      n_embd;  // width of the trunk's output rows (h)
};

// mtp_keys begins an MTP generator's metadata with the keys they all open with:
// architecture, vocabulary, context length, width and the block counts. block_count counts
// the NextN blocks too: they are stored after the trunk's.
inline keys mtp_keys(const char * arch, uint32_t n_vocab, uint32_t n_embd, uint32_t n_trunk, uint32_t n_nextn) {
    const keys k = keys::begin(arch);
    k.u32("vocab_size", n_vocab);
    k.u32("context_length", 4096);
    k.u32("embedding_length", n_embd);
    k.u32("block_count", n_trunk + n_nextn);
    k.u32("nextn_predict_layers", n_nextn);
    return k;
}

// mtp_add_moe_kv writes the MoE keys the MoE generators (glm4moe, deepseek2, cohere2moe)
// share: one leading dense block of n_ff, then MoE blocks of 2 experts of n_ff, both used,
// one shared expert, sigmoid gating (GLM-4.5's and DeepSeek V3's).
inline void mtp_add_moe_kv(const keys & k, uint32_t n_ff) {
    k.u32("leading_dense_block_count", 1);
    k.u32("feed_forward_length", n_ff);
    k.u32("expert_feed_forward_length", n_ff);
    k.u32("expert_count", 2);
    k.u32("expert_used_count", 2);
    k.u32("expert_shared_count", 1);
    k.u32("expert_gating_func", 2); // sigmoid
}

// mtp_add_attn_kv writes the attention head keys of the generators with plain
// multi-head attention (glm4moe, cohere2moe, mimo2).
inline void mtp_add_attn_kv(const keys & k, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim) {
    k.u32("attention.head_count", n_head);
    k.u32("attention.head_count_kv", n_head_kv);
    k.u32("attention.key_length", head_dim);
    k.u32("attention.value_length", head_dim);
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

// mtp_block is the block index of a tensor named blk.N.*, or -1.
inline int mtp_block(const std::string & name) {
    return name.compare(0, 4, "blk.") == 0 ? atoi(name.c_str() + 4) : -1;
}

// mtp_drop_nextn_scales removes the per-matrix scales from the NextN blocks before writing:
// without load_mtp the loaders skip a NextN block's matrices and then never ask for their
// scales, so a file that has them fails to load ("wrong number of tensors") for every user
// that does not draft with MTP. Real conversions have none.
inline void mtp_drop_nextn_scales(tensors & ts, int32_t n_trunk) {
    std::vector<tensor> kept;
    for (auto & t : ts.list) {
        const size_t dot = t.name.rfind('.');
        const std::string suffix = dot == std::string::npos ? "" : t.name.substr(dot);
        if (mtp_block(t.name) >= n_trunk && (suffix == ".scale" || suffix == ".input_scale")) {
            continue;
        }
        kept.push_back(std::move(t));
    }
    ts.list = std::move(kept);
}

const int mtp_n_check = 40; // tokens decoded by mtp_check

// How far the trunk's logits may move when every token's output row is asked for (see
// mtp_check): rounding (glm4moe's graph then runs its last block's FFN over every row).
const float mtp_rows_tolerance = 1e-4f;

inline llama_token mtp_check_token(int i) { return 4 + (i * 37) % 120; }

// mtp_trunk loads path (with or without its MTP layers) and decodes mtp_n_check tokens in
// one sequence, with every token's output row asked for (rows: embeddings on, each token's
// row appended to h) or only the last token's logits; it returns the model and context
// (nullptr on failure) and the last logits.
inline bool mtp_trunk(const mtp_model & s, const char * path, bool load_mtp, bool rows, llama_model ** mo,
                      llama_context ** co, std::vector<float> & logits, std::vector<float> * h) {
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
    cp.embeddings = rows;
    llama_context * c = llama_init_from_model(m, cp);
    *co = c;
    if (c == nullptr) {
        fprintf(stderr, "%s: no context on %s\n", s.prog, path);
        return false;
    }
    llama_batch b = llama_batch_init(mtp_n_check, 0, 1);
    for (int i = 0; i < mtp_n_check; i++) {
        b.token[i] = mtp_check_token(i);
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = rows || i == mtp_n_check - 1;
    }
    b.n_tokens = mtp_n_check;
    const int n_vocab_m = llama_vocab_n_tokens(llama_model_get_vocab(m));
    bool ok = llama_decode(c, b) == 0 && finite(llama_get_logits_ith(c, mtp_n_check - 1), n_vocab_m);
    llama_batch_free(b);
    for (int i = 0; ok && rows && i < mtp_n_check; i++) {
        const float * r = llama_get_embeddings_ith(c, i);
        ok = finite(r, s.n_embd);
        if (ok) {
            h->insert(h->end(), r, r + s.n_embd);
        }
    }
    if (!ok) {
        fprintf(stderr, "%s: the trunk of %s does not decode (load_mtp %d, rows %d)\n", s.prog, path, load_mtp, rows);
        return false;
    }
    const float * l = llama_get_logits_ith(c, mtp_n_check - 1);
    logits.assign(l, l + n_vocab_m);
    return true;
}

// mtp_check makes sure that path is a model both a plain user and a draft-mtp driver can
// run, as far as llama.cpp's public API shows it:
//  - loaded without load_mtp (PolyKV's load, llama-server without draft-mtp) it decodes
//    mtp_n_check tokens with finite logits;
//  - loaded with load_mtp it reports n_layer_nextn as written and gives the same logits bit
//    for bit (the NextN block is not part of the trunk's graph);
//  - asked for every token's output row, it gives a finite one per token and the same
//    logits within mtp_rows_tolerance;
//  - an MTP context (LLAMA_CONTEXT_TYPE_MTP) on the same model decodes the same tokens,
//    each paired with the trunk's row of the token before it (the catch-up that
//    common_speculative_impl_draft_mtp::process does), then one draft step (the last
//    token again with the last row), with finite logits.
// The rows fed here are the trunk's public output rows (after its final norm), not the
// NextN hidden-state rows a draft-mtp driver feeds: those, and the MTP context's own rows,
// are read through llama.cpp's private llama-ext.h, which only internal/llama/internals.cpp
// includes. The Go tests check them on these models instead: internal/llama's
// TestMTPContext (a finite NextN row per token, the trunk's logits unchanged with them on,
// a draft step's finite logits and row, on qwen35mtp and glm4moemtp) and
// TestMTPGreedyLossless, internal/runner's TestMTPDraftsMatchReference and
// TestMTPChainedDraftsMatchReference (mimo2mtp's two chained blocks), internal/app's
// TestMTPServed (every MTP model: drafts accepted and rejected, greedy output unchanged).
inline bool mtp_check(const mtp_model & s, const char * path) {
    llama_model * m0 = nullptr;
    llama_context * c0 = nullptr;
    std::vector<float> l0, l1, l2;
    bool ok = mtp_trunk(s, path, false, false, &m0, &c0, l0, nullptr);
    llama_free(c0);
    llama_model_free(m0);
    ok = ok && mtp_trunk(s, path, true, false, &m0, &c0, l1, nullptr);
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
    std::vector<float> h; // the trunk's output rows, mtp_n_check × n_embd
    ok = mtp_trunk(s, path, true, true, &m, &c, l2, &h);
    for (size_t i = 0; ok && i < l0.size(); i++) {
        if (fabsf(l2[i] - l0[i]) > mtp_rows_tolerance) {
            fprintf(stderr, "%s: %s gives logit %zu %g with every row out, %g without\n", s.prog, path, i, l2[i], l0[i]);
            ok = false;
        }
    }
    const int n_embd = s.n_embd;
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
        ok = ok && finite(llama_get_logits_ith(d, 0), int(l2.size()));
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
// mtp_fill with load_mtp on, written without the NextN blocks' scales
// (mtp_drop_nextn_scales; edit, if not null, changes the tensors after that), then
// checked (mtp_check). testmodel::program takes plain functions, so the generator's spec
// and edit reach them through these two variables.
inline const mtp_model * mtp_spec = nullptr;
inline void (*mtp_edit)(tensors &) = nullptr;

inline int mtp_run(const mtp_model & spec, gguf_context * (*metadata)(), void (*edit)(tensors &), int argc,
                   char ** argv) {
    mtp_spec = &spec;
    mtp_edit = edit;
    program p = {spec.prog, metadata, mtp_fill, mtp_model_params,
        [](tensors & ts) {
            mtp_drop_nextn_scales(ts, mtp_spec->n_trunk);
            if (mtp_edit != nullptr) {
                mtp_edit(ts);
            }
        },
        [](const char * path) { return mtp_check(*mtp_spec, path); }};
    return run(p, argc, argv);
}

} // namespace testmodel
