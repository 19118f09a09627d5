// deepseek2mtp-testmodel writes a tiny random-weight DeepSeek V3 (arch "deepseek2": multi-head
// latent attention, MoE) model with one MTP (NextN) block for PolyKV's speculative-decoding
// tests: `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static
// libraries and runs it once. It covers the MTP path on an MLA target, whose KV cache row is
// one compressed latent (K 576 = kv_lora_rank 512 + rope 64, V a view of it) rather than
// per-head K and V, as DeepSeek V3 and its derivatives (Kimi K2, GLM-4.7 Lite…) are.
// b11434's test-llama-archs writes its deepseek2 model without NextN layers, so, as in
// glm4moemtp-testmodel.cpp, llama_model_init_from_user (with load_mtp) builds the model from
// this program's metadata and fills every tensor (mtp_fill in mtptestmodel.h), and the GGUF
// is written from the metadata and those tensors (testmodel.h), then loaded back and
// checked (mtp_check) before it is kept.
//
// The trunk is test-llama-archs' deepseek2 fixture: 128-token vocabulary, n_embd 128, one
// head, MLA with q_lora_rank 512, kv_lora_rank 512, a 64-wide rope part and 192/128-wide
// decompressed K/V heads; one leading dense block (n_ff 192) then one MoE block (2 experts
// of 192, both used, sigmoid gating as V3, one shared expert). A third block is the MTP head,
// laid out as in DeepSeek V3's checkpoints (blk.N.nextn.*): a full MoE decoder block plus
// eh_proj, enorm, hnorm and the optional embed_tokens / shared_head_norm / shared_head_head.
// The training context is 4096 (the fixture's is 256) so tests can run longer sequences.
//
// Usage: deepseek2mtp-testmodel OUT.gguf [SEED]

#include "mtptestmodel.h"

#include <string>
#include <vector>

namespace {

const uint32_t n_vocab = 128, n_embd = 128, n_head = 1, n_ff = 192;
const uint32_t n_trunk = 2, n_nextn = 1;

const testmodel::mtp_model spec = {"deepseek2mtp-testmodel", "deepseek2", int32_t(n_trunk), int32_t(n_nextn), int32_t(n_embd)};

gguf_context * metadata() {
    const testmodel::keys k = testmodel::mtp_keys("deepseek2", n_vocab, n_embd, n_trunk, n_nextn);
    testmodel::mtp_add_moe_kv(k, n_ff);
    k.f32("expert_weights_scale", 1.0f);
    k.flag("expert_weights_norm", true);
    k.u32("attention.head_count", n_head);
    k.u32("attention.head_count_kv", n_head);
    k.u32("attention.key_length", 576);
    k.u32("attention.value_length", 512);
    k.u32("attention.key_length_mla", 192);
    k.u32("attention.value_length_mla", 128);
    k.u32("attention.q_lora_rank", 512);
    k.u32("attention.kv_lora_rank", 512);
    k.u32("rope.dimension_count", 64);
    k.f32("rope.freq_base", 10000.0f);
    k.f32("attention.layer_norm_rms_epsilon", 1e-5f);

    testmodel::add_test_tokenizer(k, n_vocab);
    return k.g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
