// glm4moemtp-testmodel writes a tiny random-weight GLM-4.5 (arch "glm4moe") model with one
// MTP (NextN) block for PolyKV's speculative-decoding tests on an attention-only target:
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once. The other MTP test model (qwen35mtp) is hybrid, on which PolyKV turns
// the pool tier and the prefix cache off; on this one both run beside the MTP drafter.
// b11434's test-llama-archs writes its glm4moe model without NextN layers, so, as in
// qwen35mtp-testmodel.cpp, llama_model_init_from_user (with load_mtp) builds the model from
// this program's metadata and fills every tensor from a seeded normal distribution (the
// MTP head made to draft plausibly: mtp_fill in mtptestmodel.h), and the GGUF is written
// from the metadata and those tensors (testmodel.h), then loaded back and checked
// (mtp_check) before it is kept.
//
// The trunk is test-llama-archs' glm4moe fixture (its MoE variant; GLM4_MOE has no dense
// one): 128-token vocabulary, n_embd 256, 2 heads of 128 (q/k norms, q/k/v biases), one
// leading dense block (n_ff 384) then one MoE block (2 experts of 384, both used, sigmoid
// gating with a probability bias, one shared expert). The fixture's rope sections are
// left out: with them llama.cpp ropes the trunk as M-RoPE (GLM-4.xV) while the MTP graph
// ropes plainly; GLM-4.5 itself has none. A third block is the MTP head, laid out as in
// GLM-4.5's checkpoints (blk.N.nextn.*): a full decoder block of the MoE kind (attention,
// post-attention norm, routed and shared experts) plus eh_proj (2·n_embd → n_embd over
// [enorm(embed(x)), hnorm(h)]), enorm, hnorm, and the optional embed_tokens /
// shared_head_norm / shared_head_head (written, so the draft graph reads every tensor it
// can). The training context is 4096 (the fixture's is 256) so tests can run longer
// sequences.
//
// Usage: glm4moemtp-testmodel OUT.gguf [SEED]

#include "mtptestmodel.h"

#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 256, n_head = 2, n_head_kv = 2, head_dim = 128, n_ff = 384;
const uint32_t n_trunk = 2, n_nextn = 1;

const testmodel::mtp_model spec = {"glm4moemtp-testmodel", "glm4moe", int32_t(n_trunk), int32_t(n_nextn), int32_t(n_embd)};

gguf_context * metadata() {
    const testmodel::keys k = testmodel::mtp_keys("glm4moe", n_vocab, n_embd, n_trunk, n_nextn);
    testmodel::mtp_add_moe_kv(k, n_ff);
    testmodel::mtp_add_attn_kv(k, n_head, n_head_kv, head_dim);
    k.f32("attention.layer_norm_rms_epsilon", 1e-5f);
    k.u32("rope.dimension_count", head_dim);
    k.f32("rope.freq_base", 10000.0f);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
