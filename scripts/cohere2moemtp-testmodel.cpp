// cohere2moemtp-testmodel writes a tiny random-weight Cohere Command A MoE (arch "cohere2moe")
// model with one MTP (NextN) block: an MTP model with sliding-window attention, for the pool
// tier's MTP part on such models (the target's part is saved window by window there).
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once; mtp_run (mtptestmodel.h) fills, saves and checks it as the other MTP
// generators do.
//
// The trunk is test-llama-archs' cohere2moe fixture in small: 128-token vocabulary, n_embd 256,
// 2 heads of 128, layer norm, a 32-position sliding window on every other layer (the first
// dense), one leading dense block (n_ff 384) then one MoE block (2 experts of 384, both used,
// sigmoid gating, one shared expert). A third block is the MTP head (blk.2.nextn.*).
//
// Usage: cohere2moemtp-testmodel OUT.gguf [SEED]

#include "mtptestmodel.h"

#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 256, n_head = 2, head_dim = 128, n_ff = 384;
const uint32_t n_trunk = 2, n_nextn = 1;

const testmodel::mtp_model spec = {"cohere2moemtp-testmodel", "cohere2moe", int32_t(n_trunk), int32_t(n_nextn), int32_t(n_embd)};

gguf_context * metadata() {
    const testmodel::keys k = testmodel::mtp_keys("cohere2moe", n_vocab, n_embd, n_trunk, n_nextn);
    testmodel::mtp_add_moe_kv(k, n_ff);
    testmodel::mtp_add_attn_kv(k, n_head, n_head, head_dim);
    k.f32("attention.layer_norm_epsilon", 1e-5f);
    k.u32("attention.sliding_window", 32);
    k.u32("attention.sliding_window_pattern", 2);
    k.f32("logit_scale", 1.0f);
    k.u32("rope.dimension_count", head_dim);
    k.f32("rope.freq_base", 10000.0f);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
