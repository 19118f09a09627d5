// gemma4testmodel.h: what scripts/gemma4-testmodel.cpp (the Gemma 4 test model) and
// scripts/gemma4assistant-testmodel.cpp (its MTP assistant) must agree on: the attention
// shape. The assistant's layers read the target's KV cache, so their KV head count, head
// sizes, RoPE and window are the target's.
#pragma once

#include "testmodel.h"

#include <cstdint>

namespace gemma4test {

const uint32_t n_head_kv = 1, head_full = 64, head_swa = 32, n_swa = 32;

// add_attention_kv writes the attention keys: n_head query heads over one KV head, 64-wide
// heads on the full layers and 32-wide on the sliding ones, RoPE over the whole head, a
// 32-position window.
inline void add_attention_kv(const testmodel::keys & k, uint32_t n_head) {
    k.u32("attention.head_count", n_head);
    k.u32("attention.head_count_kv", n_head_kv);
    k.u32("attention.key_length", head_full);
    k.u32("attention.value_length", head_full);
    k.u32("attention.key_length_swa", head_swa);
    k.u32("attention.value_length_swa", head_swa);
    k.u32("rope.dimension_count", head_full);
    k.u32("rope.dimension_count_swa", head_swa);
    k.f32("rope.freq_base", 1000000.0f);
    k.f32("rope.freq_base_swa", 10000.0f);
    k.f32("attention.layer_norm_rms_epsilon", 1e-6f);
    k.u32("attention.sliding_window", n_swa);
}

} // namespace gemma4test
