// qwen35mtp-testmodel writes a tiny random-weight Qwen3.5 model with one MTP (NextN) block
// (arch "qwen35", nextn_predict_layers = 1) for PolyKV's speculative-decoding tests:
// `scripts/llama.sh testmodels` compiles it against the pinned llama.cpp's static libraries
// and runs it once. No small real model with MTP layers is at hand, and b11434's
// test-llama-archs writes its qwen35 model without them (nextn_predict_layers = 0), so its
// approach is followed here as in gemma4-testmodel.cpp: llama.cpp's model saver writes the
// metadata, llama_model_init_from_user (with load_mtp, or the NextN tensors are skipped)
// fills every tensor from a seeded normal distribution (the MTP head made to draft
// plausibly: mtp_fill in mtptestmodel.h), and the saver writes the GGUF. The file is then
// loaded back, its trunk decoded, and llama.cpp's MTP context
// (LLAMA_CONTEXT_TYPE_MTP) created on it and run for one draft step fed by the trunk's
// NextN embeddings, so that a model llama.cpp cannot draft with is never left behind.
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
    gguf_context * g = gguf_init_empty();
    llama_model_saver ms(LLM_ARCH_QWEN35, g);

    testmodel::mtp_add_base_kv(ms, LLM_ARCH_QWEN35, n_vocab, n_embd, n_trunk, n_nextn);
    ms.add_kv(LLM_KV_FEED_FORWARD_LENGTH, n_ff);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT, n_head);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT_KV, n_head_kv);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH, head_dim);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, 1e-5f);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, head_dim);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_SECTIONS, std::vector<uint32_t>{32, 32, 32, 32});
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 10000.0f);
    // Layer 0 recurrent (gated delta net), layer 1 full attention; the MTP block (layer 2)
    // is attention-only, which the loader's default (recurrent only below n_layer()) gives.
    ms.add_kv(LLM_KV_FULL_ATTENTION_INTERVAL, uint32_t(2));
    ms.add_kv(LLM_KV_SSM_INNER_SIZE, uint32_t(256));
    ms.add_kv(LLM_KV_SSM_CONV_KERNEL, uint32_t(4));
    ms.add_kv(LLM_KV_SSM_STATE_SIZE, uint32_t(128));
    ms.add_kv(LLM_KV_SSM_TIME_STEP_RANK, n_head);
    ms.add_kv(LLM_KV_SSM_GROUP_COUNT, uint32_t(2));

    testmodel::add_test_tokenizer(ms, n_vocab);
    return g;
}

// fix writes recurrent_layers again: the saver writes per-layer arrays for the trunk's
// layers only (n_layer()), but the qwen35 loader reads it for all of them, NextN blocks
// included, so it gets one entry per block (the MTP block is not recurrent).
void fix(llama_model_saver & ms, llama_model * m) {
    const auto & hp = m->hparams;
    std::vector<uint32_t> recr(hp.is_recr_impl.begin(), hp.is_recr_impl.begin() + hp.n_layer_all);
    gguf_set_arr_data(ms.gguf_ctx, ms.llm_kv(LLM_KV_ATTENTION_RECURRENT_LAYERS).c_str(),
                      GGUF_TYPE_UINT32, recr.data(), recr.size());
}

} // namespace

int main(int argc, char ** argv) {
    return testmodel::mtp_run(spec, metadata, fix, argc, argv);
}
