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
    const testmodel::keys k = testmodel::mtp_keys("mimo2", n_vocab, n_embd, n_trunk, n_nextn);
    k.u32("feed_forward_length", n_ff);
    k.u32("expert_feed_forward_length", n_ff);
    testmodel::mtp_add_attn_kv(k, n_head, n_head, head_dim);
    k.f32("attention.layer_norm_rms_epsilon", 1e-5f);
    k.u32("attention.sliding_window", 32);
    // Per layer, 1 = sliding window: trunk full, sliding; both MTP blocks sliding (MiMo-V2's are).
    k.u32s("attention.sliding_window_pattern", {0, 1, 1, 1});
    k.u32("rope.dimension_count", head_dim);
    k.f32("rope.freq_base", 10000.0f);
    k.f32("rope.freq_base_swa", 10000.0f);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

// edit gives the MTP blocks a fused attn_qkv, which b11434's mimo2 MTP graph requires
// (GGML_ASSERT "MIMO2 MTP requires fused attn_qkv"; MiMo-V2's checkpoints have it) but its
// model builder never creates for a model built from metadata (the tensor is
// TENSOR_SKIP_IF_VIRTUAL): the separate Q, K and V weights are concatenated along the
// output dimension (Q's rows, then K's, then V's), which is the fused tensor's layout.
void edit(testmodel::tensors & ts) {
    for (uint32_t il = n_trunk; il < n_trunk + n_nextn; il++) {
        const std::string blk = "blk." + std::to_string(il) + ".";
        testmodel::tensor qkv = ts.at(blk + "attn_q.weight");
        qkv.name = blk + "attn_qkv.weight";
        for (const char * part : {"attn_k.weight", "attn_v.weight"}) {
            const testmodel::tensor & t = ts.at(blk + part);
            qkv.ne[1] += t.ne[1];
            qkv.data.insert(qkv.data.end(), t.data.begin(), t.data.end());
        }
        for (const char * part : {"attn_q.weight", "attn_k.weight", "attn_v.weight"}) {
            ts.remove(blk + part);
        }
        ts.list.push_back(std::move(qkv));
        // mtp_fill makes a head's LM head the model's and its norm 1, which gives drafts
        // that follow h where h is normed already; mimo2's h is the last block's output
        // before the model's final norm, so the head's norm is that norm's weights.
        ts.at(blk + "nextn.shared_head_norm.weight").data = ts.at("output_norm.weight").data;
    }
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, edit, argc, argv);
}
