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
    gguf_context * g = gguf_init_empty();
    llama_model_saver ms(LLM_ARCH_COHERE2MOE, g);

    testmodel::mtp_add_base_kv(ms, LLM_ARCH_COHERE2MOE, n_vocab, n_embd, n_trunk, n_nextn);
    testmodel::mtp_add_moe_kv(ms, n_ff);
    testmodel::mtp_add_attn_kv(ms, n_head, n_head, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_EPS, 1e-5f);
    ms.add_kv(LLM_KV_ATTENTION_SLIDING_WINDOW, uint32_t(32));
    ms.add_kv(LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN, uint32_t(2));
    ms.add_kv(LLM_KV_LOGIT_SCALE, 1.0f);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, head_dim);
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 10000.0f);

    testmodel::add_test_tokenizer(ms, n_vocab);
    return g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
