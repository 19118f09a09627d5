// gemma4testmodel.h: what scripts/gemma4-testmodel.cpp (the Gemma 4 test model) and
// scripts/gemma4assistant-testmodel.cpp (its MTP assistant) must agree on: the attention
// shape. The assistant's layers read the target's KV cache, so their KV head count, head
// sizes, RoPE and window are the target's.
#pragma once

#include "llama-arch.h"
#include "llama-model-saver.h"

#include <cstdint>

namespace gemma4test {

const uint32_t n_head_kv = 1, head_full = 64, head_swa = 32, n_swa = 32;

// add_attention_kv writes the attention keys, in this order (part of the files' bytes):
// n_head query heads over one KV head, 64-wide heads on the full layers and 32-wide on the
// sliding ones, RoPE over the whole head, a 32-position window.
inline void add_attention_kv(llama_model_saver & ms, uint32_t n_head) {
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT, n_head);
    ms.add_kv(LLM_KV_ATTENTION_HEAD_COUNT_KV, n_head_kv);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH, head_full);
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH, head_full);
    ms.add_kv(LLM_KV_ATTENTION_KEY_LENGTH_SWA, head_swa);
    ms.add_kv(LLM_KV_ATTENTION_VALUE_LENGTH_SWA, head_swa);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT, head_full);
    ms.add_kv(LLM_KV_ROPE_DIMENSION_COUNT_SWA, head_swa);
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE, 1000000.0f);
    ms.add_kv(LLM_KV_ROPE_FREQ_BASE_SWA, 10000.0f);
    ms.add_kv(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, 1e-6f);
    ms.add_kv(LLM_KV_ATTENTION_SLIDING_WINDOW, n_swa);
}

} // namespace gemma4test
