// mimo2mtp-testmodel writes a tiny random-weight MiMo-V2 (arch "mimo2") model with two MTP
// (NextN) blocks, which llama.cpp's draft-mtp driver chains: draft step i runs block i
// (llama_set_nextn_layer_offset). The other MTP test models have one block.
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once; mtp_run (mtptestmodel.h) fills, saves and checks it as the other MTP
// generators do.
//
// The trunk: 128-token vocabulary, n_embd 256, 2 heads of 128, RMS norm, a 32-position
// sliding window on every other layer, dense feed-forward blocks (n_ff 384; MiMo-V2's are
// MoE, which the chaining does not touch). Blocks 2 and 3 are the MTP heads
// (blk.N.nextn.*), both sliding-window layers.
//
// Usage: mimo2mtp-testmodel OUT.gguf [SEED]

#include "mtptestmodel.h"

#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 256, n_head = 2, head_dim = 128, n_ff = 384;
const uint32_t n_trunk = 2, n_nextn = 2;

const testmodel::mtp_model spec = {"mimo2mtp-testmodel", "mimo2", int32_t(n_trunk), int32_t(n_nextn), int32_t(n_embd)};

gguf_context * metadata() {
    gguf_context * g = gguf_init_empty();
    llama_model_saver ms(LLM_ARCH_MIMO2, g);

    testmodel::mtp_add_base_kv(ms, LLM_ARCH_MIMO2, n_vocab, n_embd, n_trunk, n_nextn);
    ms.add_kv(LLM_KV_FEED_FORWARD_LENGTH, n_ff);
    ms.add_kv(LLM_KV_EXPERT_FEED_FORWARD_LENGTH, n_ff);
    testmodel::mtp_add_attn_kv(ms, n_head, n_head, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, 1e-5f);
    ms.add_kv(LLM_KV_ATTENTION_SLIDING_WINDOW, uint32_t(32));
    // Per layer, 1 = sliding window: trunk full, sliding; both MTP blocks sliding (MiMo-V2's are).
    ms.add_kv(LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN, std::vector<uint32_t>{0, 1, 1, 1});
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, head_dim);
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 10000.0f);
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE_SWA, 10000.0f);

    testmodel::add_test_tokenizer(ms, n_vocab);
    return g;
}

// fix gives the MTP blocks a fused attn_qkv, which b11434's mimo2 MTP graph requires
// (GGML_ASSERT "MIMO2 MTP requires fused attn_qkv"; MiMo-V2's checkpoints have it) but its
// model builder never creates for a model built from metadata (the tensor is
// TENSOR_SKIP_IF_VIRTUAL): the separate Q, K and V weights are concatenated along the
// output dimension (Q's rows, then K's, then V's), which is the fused tensor's layout.
void fix(llama_model_saver &, llama_model * m) {
    static ggml_context * ctx = ggml_init({16u << 20, nullptr, false}); // lives until the file is written
    for (uint32_t il = n_trunk; il < n_trunk + n_nextn; il++) {
        llama_layer & l = m->layers[il];
        const int64_t rows = l.wq->ne[1] + l.wk->ne[1] + l.wv->ne[1];
        ggml_tensor * qkv = ggml_new_tensor_2d(ctx, l.wq->type, l.wq->ne[0], rows);
        ggml_set_name(qkv, ("blk." + std::to_string(il) + ".attn_qkv.weight").c_str());
        size_t off = 0;
        for (ggml_tensor * t : {l.wq, l.wk, l.wv}) {
            ggml_backend_tensor_get(t, (char *) qkv->data + off, 0, ggml_nbytes(t));
            off += ggml_nbytes(t);
        }
        l.wqkv = qkv;
        l.wq = l.wk = l.wv = nullptr;
        // mtp_fill makes a head's LM head the model's and its norm 1, which gives drafts
        // that follow h where h is normed already; mimo2's h is the last block's output
        // before the model's final norm, so the head's norm is that norm's weights.
        std::vector<float> w(ggml_nelements(m->output_norm));
        ggml_backend_tensor_get(m->output_norm, w.data(), 0, ggml_nbytes(m->output_norm));
        ggml_backend_tensor_set(l.nextn.shared_head_norm, w.data(), 0, ggml_nbytes(l.nextn.shared_head_norm));
    }
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, fix, argc, argv);
}
