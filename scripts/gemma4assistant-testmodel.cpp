// gemma4assistant-testmodel writes a tiny Gemma 4 assistant (arch "gemma4-assistant":
// Gemma 4's MTP drafter, shipped as a model file of its own beside the target) and its
// target, gemma4q.gguf: the Gemma 4 test model scripts/gemma4-testmodel.cpp writes
// (gemma4.gguf, which must be there) with its weight matrices in Q4_1 (see quantize).
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static
// libraries and runs it after that one.
//
// An assistant keeps no KV cache: its layers attend over the target's (its sliding layers
// over the target's last sliding layer's cells, its full layers over the last full
// layer's; llama.cpp shares them when the assistant's context is created with the
// target's as ctx_other). Each draft step reads the target's embedding of the token beside
// a hidden state (the target's last-layer output for the first, the assistant's own
// projected output after it) and gives logits and the next hidden state. So its head
// sizes, KV head count and window are the target's; its own width (64) is half the
// target's (128), which it gives as embedding_length_out, as the real ones do.
//
// Usage: gemma4assistant-testmodel OUT.gguf [SEED]   (writes gemma4q.gguf beside OUT too)

#include "gemma4testmodel.h"
#include "testmodel.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 64, n_embd_target = 128, n_layer = 2, n_head = 2, n_ff = 96;
// h_weight: the standard deviation of the pre-projection's weights on the hidden state.
const float h_weight = 0.05f;

// add_keys writes the assistant's keys into a new context.
gguf_context * add_keys() {
    const testmodel::keys k = testmodel::keys::begin("gemma4-assistant");
    k.u32("vocab_size", n_vocab);
    k.u32("context_length", 4096);
    k.u32("embedding_length", n_embd);
    k.u32("embedding_length_out", n_embd_target);
    k.u32("block_count", n_layer);
    // Every block of an assistant is a draft block (convert_hf_to_gguf writes the count twice).
    k.u32("nextn_predict_layers", n_layer);
    k.u32("feed_forward_length", n_ff);
    gemma4test::add_attention_kv(k, n_head); // the target's: its KV is read here
    // Block 0 slides (reads the target's last sliding layer), block 1 is full.
    k.u32s("attention.sliding_window_pattern", {1, 0});
    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

// bigram runs the target greedily after eight prompts of 40 tokens (48 tokens each) and
// gives, for each token, the token that most often followed it in those outputs (itself
// where it never appeared): what a tiny random model does is mostly a walk of such a map.
std::vector<int> bigram(const std::string & target) {
    std::vector<int> next(n_vocab);
    for (uint32_t t = 0; t < n_vocab; t++) {
        next[t] = int(t);
    }
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = testmodel::quiet;
    llama_model * m = llama_model_load_from_file(target.c_str(), mp);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * c = m == nullptr ? nullptr : llama_init_from_model(m, cp);
    if (c == nullptr) {
        llama_model_free(m);
        return {};
    }
    std::vector<std::vector<int>> count(n_vocab, std::vector<int>(n_vocab, 0));
    llama_batch b = llama_batch_init(64, 0, 1);
    auto decode = [&](const std::vector<llama_token> & toks, int pos) {
        b.n_tokens = 0;
        for (size_t i = 0; i < toks.size(); i++) {
            b.token[i] = toks[i];
            b.pos[i] = pos + int(i);
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = i + 1 == toks.size();
            b.n_tokens++;
        }
        if (llama_decode(c, b) != 0) {
            return -1;
        }
        const float * l = llama_get_logits_ith(c, -1);
        return int(std::max_element(l, l + n_vocab) - l);
    };
    bool ok = true;
    for (int p = 0; ok && p < 8; p++) {
        llama_memory_clear(llama_get_memory(c), true);
        std::vector<llama_token> prompt(40);
        for (int i = 0; i < 40; i++) {
            prompt[i] = 4 + (p * 53 + i * 37 + i * i) % 120;
        }
        int tok = decode(prompt, 0), prev = -1;
        for (int i = 0; ok && i < 48; i++) {
            ok = tok >= 0;
            if (ok && prev >= 0) {
                count[prev][tok]++;
            }
            prev = tok;
            tok = ok ? decode({llama_token(tok)}, 40 + i) : -1;
        }
    }
    llama_batch_free(b);
    llama_free(c);
    llama_model_free(m);
    if (!ok) {
        return {};
    }
    for (uint32_t t = 0; t < n_vocab; t++) {
        const auto & r = count[t];
        const int best = int(std::max_element(r.begin(), r.end()) - r.begin());
        if (r[best] > 0) {
            next[t] = best;
        }
    }
    return next;
}

// write writes the file: the keys, then every tensor the loader reads (the names and
// shapes of src/models/gemma4-assistant.cpp) in F32. Random weights alone would never
// draft what the target says (the assistant's output head is its own), and the tests
// need drafts both accepted and rejected, so the assistant is built to predict the
// target's bigram (above): the pre-projection copies the first 64 values of the token's
// (target) embedding into its width and adds a small random projection of the hidden
// state (so that drafts depend on it: a wrong row changes them); the output head's row for
// token v is the sum of those 64 values over the tokens the bigram sends to v, and the
// final norm's weights are 1, so the token's successor scores highest. The blocks (N(0,
// 0.1) weights seeded by the tensor's name, as test-llama-archs draws them; RoPE factors
// and output scales 1) perturb it. Written with gguf directly, not through llama.cpp's
// model builder as the other generators are: b11434's builder sizes a model's tensor
// context by its trunk's layer count, which an assistant does not have (its build aborts
// in ggml_new_tensor), and cannot place the optional masked-embedding tensors Gemma 4's
// loader asks for.
bool write(const std::string & out, const std::string & target, unsigned long seed) {
    const std::vector<int> next = bigram(target);
    ggml_context * tctx = nullptr;
    gguf_context * tg = gguf_init_from_file(target.c_str(), {false, &tctx});
    ggml_tensor * te = tg == nullptr ? nullptr : ggml_get_tensor(tctx, "token_embd.weight");
    const ggml_type_traits * tt = te == nullptr ? nullptr : ggml_get_type_traits(te->type);
    if (next.empty() || te == nullptr || te->ne[0] != n_embd_target || te->ne[1] != n_vocab || tt->to_float == nullptr) {
        fprintf(stderr, "gemma4assistant-testmodel: %s does not run, or has no %u x %u token_embd\n", target.c_str(), n_embd_target, n_vocab);
        gguf_free(tg);
        ggml_free(tctx);
        return false;
    }
    std::vector<float> emb(size_t(n_vocab) * n_embd_target); // the target's, dequantized
    for (uint32_t t = 0; t < n_vocab; t++) {
        tt->to_float((const char *) te->data + t * te->nb[1], emb.data() + size_t(t) * n_embd_target, n_embd_target);
    }
    gguf_context * g = add_keys();
    ggml_init_params ip = {64u << 20, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    // add adds a tensor with values vals (if given), else drawn.
    auto add = [&](const std::string & name, std::initializer_list<int64_t> ne, const std::vector<float> * vals = nullptr) {
        int64_t d[4] = {1, 1, 1, 1};
        int n = 0;
        for (int64_t x : ne) {
            d[n++] = x;
        }
        ggml_tensor * t = ggml_new_tensor(ctx, GGML_TYPE_F32, n, d);
        ggml_set_name(t, name.c_str());
        std::mt19937 gen(seed ^ std::hash<std::string>{}(name));
        std::normal_distribution<float> dis(0.0f, 0.1f);
        const bool ones = name == "rope_freqs.weight" || name == "output_norm.weight" || name.find("layer_output_scale") != std::string::npos;
        float * v = static_cast<float *>(t->data);
        for (int64_t i = 0; i < ggml_nelements(t); i++) {
            v[i] = vals != nullptr ? (*vals)[i] : ones ? 1.0f : dis(gen);
        }
        gguf_add_tensor(g, t);
    };
    std::vector<float> head(size_t(n_vocab) * n_embd, 0.0f);
    for (uint32_t t = 0; t < n_vocab; t++) {
        for (uint32_t i = 0; i < n_embd; i++) {
            head[size_t(next[t]) * n_embd + i] += emb[size_t(t) * n_embd_target + i];
        }
    }
    add("token_embd.weight", {n_embd, n_vocab}, &head);
    std::vector<float> pre(size_t(2 * n_embd_target) * n_embd, 0.0f);
    std::mt19937 gen(seed);
    std::normal_distribution<float> dis(0.0f, h_weight);
    for (uint32_t o = 0; o < n_embd; o++) {
        float * row = pre.data() + size_t(o) * 2 * n_embd_target; // [token embedding | h]
        row[o] = 1.0f;
        for (uint32_t i = 0; i < n_embd_target; i++) {
            row[n_embd_target + i] = dis(gen);
        }
    }
    add("nextn.pre_projection.weight", {2 * n_embd_target, n_embd}, &pre);
    add("output_norm.weight", {n_embd});
    add("nextn.post_projection.weight", {n_embd, n_embd_target});
    for (uint32_t i = 0; i < n_layer; i++) {
        const std::string b = "blk." + std::to_string(i) + ".";
        const int64_t head = i == 0 ? gemma4test::head_swa : gemma4test::head_full;
        add(b + "attn_norm.weight", {n_embd});
        add(b + "attn_q.weight", {n_embd, head * n_head});
        add(b + "attn_output.weight", {head * n_head, n_embd});
        add(b + "attn_q_norm.weight", {head});
        add(b + "post_attention_norm.weight", {n_embd});
        add(b + "layer_output_scale.weight", {1});
        if (i == 1) {
            add("rope_freqs.weight", {head / 2});
        }
        add(b + "ffn_norm.weight", {n_embd});
        add(b + "ffn_gate.weight", {n_embd, n_ff});
        add(b + "ffn_up.weight", {n_embd, n_ff});
        add(b + "ffn_down.weight", {n_ff, n_embd});
        add(b + "post_ffw_norm.weight", {n_embd});
    }
    const bool ok = gguf_write_to_file(g, out.c_str(), false);
    if (!ok) {
        fprintf(stderr, "gemma4assistant-testmodel: cannot write %s\n", out.c_str());
    }
    ggml_free(ctx);
    gguf_free(g);
    ggml_free(tctx);
    gguf_free(tg);
    return ok;
}

// dir_of is path's directory, with its slash.
std::string dir_of(const std::string & path) {
    return path.substr(0, path.find_last_of('/') + 1);
}

// quantize writes gemma4q.gguf: gemma4.gguf (F32 weights, as llama.cpp's builder writes
// random models) with every weight matrix in Q4_1 (llama_model_quantize, --pure), the
// assistant's target. Q4_1 products run PolyKV's batch-independent kernel, as a served
// GGUF's do; ggml's F32 ones are not (their result moves with the batch's row count), so
// on the F32 model the target's logprobs moved by up to 1.2e-5 between runs with and
// without drafts once its hidden-state rows were on (the last layer then runs every row,
// not only the sampled ones), and 0 on the Q4_1 model.
bool quantize(const std::string & dir) {
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.nthread = 2;
    qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_1;
    qp.pure = true;
    const std::string in = dir + "gemma4.gguf", out = dir + "gemma4q.gguf", tmp = out + ".tmp";
    if (llama_model_quantize(in.c_str(), tmp.c_str(), &qp) != 0 || rename(tmp.c_str(), out.c_str()) != 0) {
        fprintf(stderr, "gemma4assistant-testmodel: cannot quantize %s\n", in.c_str());
        remove(tmp.c_str());
        return false;
    }
    return true;
}

// target_of is the assistant's target: gemma4q.gguf beside path.
std::string target_of(const std::string & path) {
    return dir_of(path) + "gemma4q.gguf";
}

// check loads the target (gemma4q.gguf beside OUT) and decodes 80 tokens in one sequence
// (past the 32-position window) with the last one's output row, then the assistant at path
// in a context over the target's and runs two draft steps the way llama.cpp's draft-mtp
// driver does with a shared cache (both at the next token's position, each fed that row):
// finite logits, or the file is not kept. The row is the target's public output row
// (after its final norm), not the hidden-state row a driver feeds, and the assistant's
// own row, which a driver feeds to its second step, is not read: both come through
// llama.cpp's private llama-ext.h, which only internal/llama/internals.cpp includes.
// internal/runner's TestAssistantDraftsMatchReference and internal/app's TestMTPServed
// (gemma4q) run the assistant with those rows.
bool check(const char * path) {
    const std::string target = target_of(path);
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = testmodel::quiet;
    llama_model * tm = llama_model_load_from_file(target.c_str(), mp);
    llama_model * am = tm == nullptr ? nullptr : llama_model_load_from_file(path, mp);
    if (am == nullptr) {
        fprintf(stderr, "gemma4assistant-testmodel: %s or %s does not load\n", target.c_str(), path);
        llama_model_free(tm);
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context_params tp = cp;
    tp.embeddings = true;
    llama_context * tc = llama_init_from_model(tm, tp);
    bool ok = tc != nullptr;
    const int n = 80;
    std::vector<float> h;
    if (ok) {
        llama_batch b = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            b.token[i] = 4 + (i * 37) % 120;
            b.pos[i] = i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = i == n - 1;
        }
        b.n_tokens = n;
        ok = llama_decode(tc, b) == 0;
        llama_batch_free(b);
        const float * r = ok ? llama_get_embeddings_ith(tc, n - 1) : nullptr;
        ok = testmodel::finite(r, n_embd_target);
        if (ok) {
            h.assign(r, r + n_embd_target);
        } else {
            fprintf(stderr, "gemma4assistant-testmodel: the target %s gives no output row\n", target.c_str());
        }
    }
    llama_context * ac = nullptr;
    if (ok) {
        llama_context_params dp = cp;
        dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        dp.ctx_other = tc;
        ac = llama_init_from_model(am, dp);
        ok = ac != nullptr;
    }
    if (ok) {
        llama_batch_ext * e = llama_batch_ext_init(ac);
        for (int step = 0; ok && step < 2; step++) {
            llama_batch_ext_clear(e);
            const llama_pos pos = n;
            const int32_t idx = llama_batch_ext_add_token(e, 0, 4 + step);
            ok = idx >= 0 && llama_batch_ext_set_pos(e, idx, &pos) &&
                 llama_batch_ext_set_embd_token(e, idx, {h.data(), 1, size_t(n_embd_target)}) &&
                 llama_batch_ext_set_output_logits(e, idx, true) &&
                 llama_process(ac, LLAMA_PROCESS_TYPE_DECODE, e) == 0 &&
                 testmodel::finite(llama_get_logits_ith(ac, 0), int(n_vocab));
        }
        llama_batch_ext_free(e);
    }
    if (!ok) {
        fprintf(stderr, "gemma4assistant-testmodel: %s does not draft over %s\n", path, target.c_str());
    }
    llama_free(ac);
    llama_free(tc);
    llama_model_free(am);
    llama_model_free(tm);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s OUT.gguf [SEED]\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            fputs(text, stderr);
        }
    }, nullptr);
    const std::string out = argv[1];
    if (!quantize(dir_of(out))) {
        return 1;
    }
    if (!write(out, target_of(out), argc == 3 ? strtoul(argv[2], nullptr, 10) : 42ul) || !check(out.c_str())) {
        remove(out.c_str());
        return 1;
    }
    llama_backend_free();
    return 0;
}
