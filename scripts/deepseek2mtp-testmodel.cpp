// deepseek2mtp-testmodel writes a tiny random-weight DeepSeek V3 (arch "deepseek2": multi-head
// latent attention, MoE) model with one MTP (NextN) block for PolyKV's speculative-decoding
// tests: `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static
// libraries and runs it once. It covers the MTP path on an MLA target, whose KV cache row is
// one compressed latent (K 576 = kv_lora_rank 512 + rope 64, V a view of it) rather than
// per-head K and V, as DeepSeek V3 and its derivatives (Kimi K2, GLM-4.7 Lite…) are.
// b11434's test-llama-archs writes its deepseek2 model without NextN layers, so, as in
// glm4moemtp-testmodel.cpp, llama.cpp's model saver writes the metadata,
// llama_model_init_from_user (with load_mtp) fills every tensor (mtp_fill in mtptestmodel.h),
// and the saver writes the GGUF, which is loaded back and checked (mtp_check) before it is kept.
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
    gguf_context * g = gguf_init_empty();
    llama_model_saver ms(LLM_ARCH_DEEPSEEK2, g);

    testmodel::mtp_add_base_kv(ms, LLM_ARCH_DEEPSEEK2, n_vocab, n_embd, n_trunk, n_nextn);
    testmodel::mtp_add_moe_kv(ms, n_ff);
    ms.add_kv(LLM_KV_EXPERT_WEIGHTS_SCALE, 1.0f);
    ms.add_kv(LLM_KV_EXPERT_WEIGHTS_NORM, true);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT, n_head);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT_KV, n_head);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH, uint32_t(576));
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH, uint32_t(512));
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH_MLA, uint32_t(192));
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH_MLA, uint32_t(128));
    ms.add_kv(LLM_KV_ATTENTION_Q_LORA_RANK, uint32_t(512));
    ms.add_kv(LLM_KV_ATTENTION_KV_LORA_RANK, uint32_t(512));
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, uint32_t(64));
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 10000.0f);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, 1e-5f);

    testmodel::add_test_tokenizer(ms, n_vocab);
    return g;
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, nullptr, argc, argv);
}
