// qwen35mtp-testmodel writes a tiny random-weight Qwen3.5 model with one MTP (NextN) block
// (arch "qwen35", nextn_predict_layers = 1) for PolyKV's speculative-decoding tests:
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once. No small real model with MTP layers is at hand, and b11434's
// test-llama-archs writes its qwen35 model without them (nextn_predict_layers = 0), so its
// approach is followed here as in gemma4-testmodel.cpp: llama_model_init_from_user (with
// load_mtp, or the NextN tensors are skipped) builds the model from this program's
// metadata and fills every tensor from a seeded normal distribution (the MTP head made to
// draft plausibly: mtp_fill in mtptestmodel.h), and the GGUF is written from the metadata
// and the tensors fill wrote (testmodel.h). The file is then loaded back, its trunk
// decoded, and llama.cpp's MTP context (LLAMA_CONTEXT_TYPE_MTP) created on it and run for
// one draft step fed by the trunk's output rows, so that a model llama.cpp cannot draft
// with is never left behind.
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

#include "mtptestmodel.h"

#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 256, n_head = 2, n_head_kv = 2, head_dim = 128, n_ff = 384;
const uint32_t n_trunk = 2, n_nextn = 1;

const testmodel::mtp_model spec = {"qwen35mtp-testmodel", "qwen35", int32_t(n_trunk), int32_t(n_nextn), int32_t(n_embd)};

gguf_context * metadata() {
    const testmodel::keys k = testmodel::mtp_keys("qwen35", n_vocab, n_embd, n_trunk, n_nextn);
    k.u32("feed_forward_length", n_ff);
    testmodel::mtp_add_attn_kv(k, n_head, n_head_kv, head_dim);
    k.f32("attention.layer_norm_rms_epsilon", 1e-5f);
    k.u32("rope.dimension_count", head_dim);
    k.u32s("rope.dimension_sections", {32, 32, 32, 32});
    k.f32("rope.freq_base", 10000.0f);
    // Layer 0 recurrent (gated delta net), layer 1 full attention; the MTP block (layer 2)
    // is attention-only, which the loader's default (recurrent only below n_layer()) gives.
    k.u32("full_attention_interval", 2);
    k.u32("ssm.inner_size", 256);
    k.u32("ssm.conv_kernel", 4);
    k.u32("ssm.state_size", 128);
    k.u32("ssm.time_step_rank", n_head);
    k.u32("ssm.group_count", 2);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
