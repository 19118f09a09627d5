// PolyKV's CPU matrix kernel for Q4_1, Q4_K and Q6_K weights, installed beside the
// flash-attention kernel through ggml-cpu's extra-buffer-type hook (internals.cpp
// registers it; fattn.cpp's dispatcher asks polykv_kq_kernel_for here about MUL_MAT
// nodes).
//
// Why our own kernel: it was written when PolyKV linked the llama.cpp the ollama Go module
// vendored (ec98e2002), whose ggml computed these products one (weight row, activation
// row) pair at a time (ggml_vec_dot_q4_K_q8_K etc.; llamafile's tiled sgemm covers
// Q4_0/Q5_0/Q8_0 but not these), unpacking the weights and their scales again for every
// token of a prompt batch. The pinned release PolyKV links now (llama.cpp.pin, b11434)
// still has no tiled path for Q4_1 (this kernel: 3.0x at 128 tokens, 2.1x at 2,000,
// docs/benchmarks.md); it tiles K-quants for batches of 8+ rows, and ggml's "repack"
// layout groups rows by 4; both compute a row of a batch differently from a row alone,
// which would break PolyKV's promise that a token's logits do not depend on the batch
// (measured for repack: 0.214 in a logprob). This kernel unpacks each block of 8 weight
// rows once per product and reuses it for every activation row (the codes transposed so
// one 32-bit lane is one weight row).
//
// Why it keeps a token's logits independent of the batch: each output element is the
// same fixed sequence of operations whatever the batch size, the tile or the thread:
// - per block (256 values for K-quants, 32 for Q4_1) the integer sums (scale x dot of the
//   codes per sub-block; the min or offset term) are exact in int32, so any order or
//   method gives the same integers;
// - the float part is one fixed sequence per block, in block order (finish): Q4_K
//   acc = fma(d_act * d, float(sumi), acc), then acc = fma(-(d_act * dmin), float(summ),
//   acc); Q6_K one fma; Q4_1 acc = fma(d_act * d, float(dot), acc), then
//   acc = fma(m, s_act, acc). Each element lives in one SIMD lane (lanes are weight
//   rows), so the tile or path that computes a column changes nothing.
// One to three activation rows (decode) take a direct path (no packing) that computes the
// same integers row-wise and ends in the same finish; TestKQuantKernel checks all paths
// bit for bit. Everything else (other types, batched 3-D/4-D products, MUL_MAT_ID) stays
// with ggml.

#include "kquant.h"
#include "internals.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int kRows = 8;  // weight rows per block: one lane each in a 256-bit register
constexpr int kCols = 4;  // activation rows computed together (sharing weight loads)
constexpr int kQK = 256;  // values per super-block
constexpr int kChunk = 64; // activation rows per pass over a thread's packed weights
// kPackBudget is the bytes of packed weights a thread holds at once (the self-test passes
// a smaller budget to exercise the grouped path).
constexpr size_t kPackBudget = 4 << 20;

// group_blocks is how many packed 8-row blocks of nsb blocks each fit budget (at least
// one): a vocabulary-sized output matrix is packed a group at a time.
int64_t group_blocks(int64_t nsb, size_t packed, size_t budget) {
    const int64_t g = (int64_t) (budget / ((size_t) nsb * packed));
    return g > 0 ? g : 1;
}

std::atomic<unsigned long long> computed{0};

// The models' own choices, by weight buffer (choose_buffer): a model that
// chose anything but this kernel on its best path (kernel 1, which needs no entry) has
// its weight buffers here. Why per model and not per context: the kernel's choice is
// about the weights, which every context of a model shares, and ggml-cpu asks its extras
// about a node alone (get_tensor_traits(op)), where the weights' buffer tells the model;
// what would tell a context (the node's compute buffer) is reallocated by llama.cpp's
// scheduler whenever a graph outgrows it. A lock-free table: every thread asks once per
// MUL_MAT node of a graph.
constexpr int kChoices = 64;
struct buffer_choice {
    std::atomic<const void *> buf{nullptr};
    std::atomic<int>          kernel{1};
};
buffer_choice choices[kChoices];
std::mutex    choices_mu; // writers only

// chosen is the kernel w's model chose (1: this one, its best path; 2: ggml's; 3: this
// one, its AVX2 path).
int chosen(const ggml_tensor * w) {
    if (const void * b = w->buffer) {
        for (const buffer_choice & c : choices) {
            if (c.buf.load(std::memory_order_acquire) == b) {
                return c.kernel.load(std::memory_order_relaxed);
            }
        }
    }
    return 1;
}

// The activation side: ggml's block_q8_K (ggml-common.h), restated because that header
// cannot be included twice in one translation unit with the C++ declarations.
struct q8k {
    float d;
    int8_t qs[kQK];
    int16_t bsums[kQK / 16];
};
static_assert(sizeof(q8k) == 4 + 256 + 32, "q8_K layout");

struct q4k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[kQK / 2];
};
static_assert(sizeof(q4k) == 144, "q4_K layout");

// ggml's block_q4_1 (32 values: d x code + m) and block_q8_1 (32 values; s = d x the
// sum of the codes), the activation side of Q4_1 products.
struct q41 {
    uint16_t d, m;
    uint8_t qs[16];
};
static_assert(sizeof(q41) == 20, "q4_1 layout");

struct q81 {
    uint16_t d, s;
    int8_t qs[32];
};
static_assert(sizeof(q81) == 36, "q8_1 layout");

struct q6k {
    uint8_t ql[kQK / 2];
    uint8_t qh[kQK / 4];
    int8_t scales[kQK / 16];
    uint16_t d;
};
static_assert(sizeof(q6k) == 210, "q6_K layout");

// The kernel body, compiled twice: for the build's target (AVX2: the maddubs path of
// dot4) and for AVX-512 VNNI (dpbusd), picked by has_vnni (and the model's choice). Both
// compute the same exact int32 sums and the same float sequence, so they give the same
// bits.
// (GCC's target pragma does not define the feature macros, so POLYKV_KQ_VNNI tells the
// body which dot4 to compile.)
#define POLYKV_KQ_VNNI 0
namespace avx2 {
#include "kquant_body.h"
}  // namespace avx2
#undef POLYKV_KQ_VNNI

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define POLYKV_KQ_VNNI 1
namespace vnni {
#include "kquant_body.h"
}  // namespace vnni
#undef POLYKV_KQ_VNNI
#pragma GCC pop_options

// has_vnni: the CPU has AVX-512 VNNI (and VL for its 256-bit form), the kernel's best
// path; a model may choose the AVX2 path instead (kernel 3: tests run what CPUs without
// VNNI run). (__builtin_cpu_init first: this initializer may run before libgcc's own
// constructor has filled in the CPU model, and would then read "no VNNI".)
const bool has_vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}();

size_t packed_bytes(ggml_type t) {
    switch (t) {
    case GGML_TYPE_Q4_K: return sizeof(avx2::packed<avx2::kq4>);
    case GGML_TYPE_Q6_K: return sizeof(avx2::packed<avx2::kq6>);
    default: return sizeof(avx2::packed<avx2::kq41>);
    }
}

// block_values is how many values one weight block holds (the kernel's unit along K).
int64_t block_values(ggml_type t) { return t == GGML_TYPE_Q4_1 ? avx2::kq41::kQK : kQK; }

// act_type is the type the activation rows are quantized to for weight type t.
ggml_type act_type(ggml_type t) { return t == GGML_TYPE_Q4_1 ? avx2::kq41::kAct : avx2::kq4::kAct; }

// thread_rows is the contiguous weight-row range [r0, r1) of thread ith of nth, in whole
// blocks of kRows.
void thread_rows(int64_t M, int ith, int nth, int64_t & r0, int64_t & r1) {
    const int64_t nblk = (M + kRows - 1) / kRows;
    const int64_t b0 = nblk * ith / nth, b1 = nblk * (ith + 1) / nth;
    r0 = b0 * kRows;
    r1 = b1 * kRows < M ? b1 * kRows : M;
}

// scratch_bytes is what rows needs per thread for an M x K matrix and N activation rows:
// the integer sums of the direct path, or the packed blocks it holds at once.
size_t scratch_bytes(ggml_type t, int64_t M, int64_t K, int64_t N, int nth, size_t budget) {
    const int64_t nblk = (M + kRows - 1) / kRows;
    const int64_t most = (nblk + nth - 1) / nth;
    const int64_t nsb = K / block_values(t);
    const int64_t held = N < kCols ? 0 : N <= kChunk ? 1 : std::min(most, group_blocks(nsb, packed_bytes(t), budget));
    const size_t packs = (size_t) held * nsb * packed_bytes(t);
    const size_t direct_sums = (size_t) (2 * (kCols - 1) + 2) * nsb * kRows * 4; // direct's integer sums and scales
    return (packs > direct_sums ? packs : direct_sums) + 64;
}

// compute runs weight rows [r0, r1) times N activation rows on the VNNI path (vnni) or
// the AVX2 path, holding at most budget bytes of packed weights at once.
void compute(ggml_type t, const char * w, size_t wstride, int64_t r0, int64_t r1, int64_t K, const char * act, size_t astride, int64_t N,
             char * dst, size_t dstride, void * scratch, bool vnni, size_t budget) {
#define POLYKV_KQ_ROWS(ns)                                                                                             \
    switch (t) {                                                                                                       \
    case GGML_TYPE_Q4_K: ns::rows<ns::kq4>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch, budget); break;  \
    case GGML_TYPE_Q6_K: ns::rows<ns::kq6>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch, budget); break;  \
    default: ns::rows<ns::kq41>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch, budget); break;             \
    }
    if (vnni) {
        POLYKV_KQ_ROWS(vnni)
    } else {
        POLYKV_KQ_ROWS(avx2)
    }
#undef POLYKV_KQ_ROWS
}

bool supported(const ggml_tensor * op) {
    if (op->op != GGML_OP_MUL_MAT) {
        return false;
    }
    const ggml_tensor * w = op->src[0], * x = op->src[1];
    if (w->type != GGML_TYPE_Q4_K && w->type != GGML_TYPE_Q6_K && w->type != GGML_TYPE_Q4_1) {
        return false;
    }
    if (x->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32) {
        return false;
    }
    // Plain 2-D products with contiguous rows (llama.cpp's weight matmuls); batched
    // and permuted ones stay with ggml.
    if (w->ne[2] != 1 || w->ne[3] != 1 || x->ne[2] != 1 || x->ne[3] != 1 || op->ne[2] != 1 || op->ne[3] != 1) {
        return false;
    }
    if (w->ne[0] % block_values(w->type) != 0 || x->ne[0] != w->ne[0] || op->ne[0] != w->ne[1] || op->ne[1] != x->ne[1]) {
        return false;
    }
    return w->nb[0] == ggml_type_size(w->type) && x->nb[0] == sizeof(float) && op->nb[0] == sizeof(float);
}

// act_row_bytes is the size of one activation row quantized for weight type t.
size_t act_row_bytes(ggml_type t, int64_t K) { return ggml_row_size(act_type(t), K); }

size_t work_bytes(const ggml_tensor * op, int nth) {
    const ggml_tensor * w = op->src[0], * x = op->src[1];
    const size_t q8 = (act_row_bytes(w->type, x->ne[0]) * x->ne[1] + 63) & ~(size_t) 63;
    const size_t per = (scratch_bytes(w->type, w->ne[1], w->ne[0], x->ne[1], nth, kPackBudget) + 63) & ~(size_t) 63;
    return 64 + q8 + per * nth;
}

// traits is the kernel as ggml-cpu runs it (polykv_kernel: internals.cpp adapts it), on
// the CPU's best path (VNNI) or, where the model chose it, the AVX2 path.
template <bool avx2_only>
class traits {
  public:
    static bool work_size(int n_threads, const ggml_tensor * op, size_t * size) {
        *size = work_bytes(op, n_threads);
        return true;
    }

    static bool compute_forward(const polykv_compute * params, ggml_tensor * op) {
        const ggml_tensor * w = op->src[0], * x = op->src[1];
        const int ith = params->ith, nth = params->nth;
        if (params->wsize < work_bytes(op, nth)) {
            return false; // planned without us (chosen mid-graph): ggml's kernel
        }
        const int64_t K = w->ne[0], M = w->ne[1], N = x->ne[1];
        char * base = (char *) (((uintptr_t) params->wdata + 63) & ~(uintptr_t) 63);
        const size_t qrow = act_row_bytes(w->type, K);
        const size_t q8 = (qrow * N + 63) & ~(size_t) 63;
        const size_t per = (scratch_bytes(w->type, M, K, N, nth, kPackBudget) + 63) & ~(size_t) 63;
        // Phase 1: the activation rows to q8_K or q8_1 (ggml's own quantizer, so a row's
        // quantization is a function of the row alone), split among threads.
        const ggml_from_float_t quantize = ggml_get_type_traits_cpu(act_type(w->type))->from_float;
        for (int64_t n = ith; n < N; n += nth) {
            quantize((const float *) ((const char *) x->data + n * x->nb[1]), base + n * qrow, K);
        }
        if (ith == 0) {
            computed.fetch_add(1, std::memory_order_relaxed);
        }
        polykv_barrier(params);
        // Phase 2: each thread its contiguous share of weight rows, all activation rows.
        int64_t r0, r1;
        thread_rows(M, ith, nth, r0, r1);
        if (r0 < r1) {
            compute(w->type, (const char *) w->data, w->nb[1], r0, r1, K, base, qrow, N, (char *) op->data, op->nb[1],
                    base + q8 + per * ith, has_vnni && !avx2_only, kPackBudget);
        }
        return true;
    }
};

const polykv_kernel kq_best = {traits<false>::work_size, traits<false>::compute_forward};
const polykv_kernel kq_avx2 = {traits<true>::work_size, traits<true>::compute_forward};

// choose_buffer records kernel for weights in buf (false if the table is full);
// forget_buffer drops it (kernel 1 needs no entry).
bool choose_buffer(const void * buf, int kernel) {
    std::lock_guard<std::mutex> lock(choices_mu);
    for (buffer_choice & c : choices) {
        if (c.buf.load() == buf) {
            c.kernel.store(kernel);
            return true;
        }
    }
    for (buffer_choice & c : choices) {
        if (c.buf.load() == nullptr) {
            c.kernel.store(kernel);
            c.buf.store(buf, std::memory_order_release);
            return true;
        }
    }
    return false;
}

void forget_buffer(const void * buf) {
    std::lock_guard<std::mutex> lock(choices_mu);
    for (buffer_choice & c : choices) {
        if (c.buf.load() == buf) {
            c.buf.store(nullptr, std::memory_order_release);
        }
    }
}

// model_buffers is the host buffers holding model's weights (internals.h).
std::vector<const void *> model_buffers(const struct llama_model * model) {
    std::vector<const void *> bufs(8);
    int n = polykv_model_host_buffers(model, bufs.data(), (int) bufs.size());
    if (n > (int) bufs.size()) {
        bufs.resize(n);
        n = polykv_model_host_buffers(model, bufs.data(), n);
    }
    bufs.resize(n);
    return bufs;
}

}  // namespace

const polykv_kernel * polykv_kq_kernel_for(const ggml_tensor * op) {
    if (!supported(op)) {
        return nullptr;
    }
    switch (chosen(op->src[0])) {
    case 2: return nullptr;
    case 3: return &kq_avx2;
    default: return &kq_best;
    }
}

const polykv_kernel * polykv_kq_kernel(bool avx2_only) { return avx2_only ? &kq_avx2 : &kq_best; }

extern "C" int polykv_kq_model_choose(struct llama_model * model, int kernel) {
    const std::vector<const void *> bufs = model_buffers(model);
    for (const void * b : bufs) {
        if (kernel == 1) {
            forget_buffer(b);
        } else if (!choose_buffer(b, kernel)) {
            for (const void * x : bufs) {
                forget_buffer(x);
            }
            return 0;
        }
    }
    return 1;
}

extern "C" void polykv_kq_model_forget(struct llama_model * model) {
    for (const void * b : model_buffers(model)) {
        forget_buffer(b);
    }
}

extern "C" unsigned long long polykv_kq_computed(void) { return computed.load(); }

extern "C" int polykv_kq_available(void) { return 1; }

extern "C" int polykv_kq_vnni(void) { return has_vnni ? 1 : 0; }

// polykv_kq_selftest quantizes a random M x K matrix to type and N random activation
// rows (q8_K or q8_1), computes the product with this kernel for all N rows at once, for
// each row alone, for the rows in groups of 3 and all at once packing one 8-row block at
// a time, and with ggml's vec_dot. It reports the largest difference from ggml relative
// to the largest |result|, and whether the four kernel runs agree bit for bit.
extern "C" int polykv_kq_selftest(int type, int M, int K, int N, unsigned seed, double * max_rel, int * identical, int * paths) {
    const ggml_type t = (ggml_type) type;
    if ((t != GGML_TYPE_Q4_K && t != GGML_TYPE_Q6_K && t != GGML_TYPE_Q4_1) || K % block_values(t) != 0 || M < 1 || N < 1) {
        return -1;
    }
    ggml_cpu_init(); // ggml-cpu's tables (a test may run before any model is loaded)
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> wf((size_t) M * K), xf((size_t) N * K);
    for (auto & v : wf) {
        v = nd(rng) * 0.05f;
    }
    for (auto & v : xf) {
        v = nd(rng);
    }
    const size_t wrow = ggml_row_size(t, K);
    std::vector<char> wq(wrow * M);
    ggml_quantize_chunk(t, wf.data(), wq.data(), 0, M, K, nullptr);
    const size_t qrow = act_row_bytes(t, K);
    std::vector<char> xq(qrow * N);
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(act_type(t))->from_float;
    for (int n = 0; n < N; n++) {
        quantize(xf.data() + (size_t) n * K, xq.data() + n * qrow, K);
    }
    // Two "threads" (row ranges) as the graph would split them with nth = 2.
    bool vnni = has_vnni;           // the path run (the other one is checked below)
    size_t budget = kPackBudget;     // lowered below to exercise the grouped path
    auto run = [&](int64_t c0, int64_t cn, std::vector<float> & out) {
        for (int ith = 0; ith < 2; ith++) {
            int64_t r0, r1;
            thread_rows(M, ith, 2, r0, r1);
            if (r0 >= r1) {
                continue;
            }
            void * s = aligned_alloc(64, (scratch_bytes(t, M, K, cn, 2, budget) + 63) & ~(size_t) 63);
            compute(t, wq.data(), wrow, r0, r1, K, xq.data() + c0 * qrow, qrow, cn, (char *) (out.data() + c0 * M), M * sizeof(float), s,
                    vnni, budget);
            free(s);
        }
    };
    std::vector<float> all((size_t) N * M), one((size_t) N * M), three((size_t) N * M), grouped((size_t) N * M);
    run(0, N, all);
    for (int n = 0; n < N; n++) {
        run(n, 1, one);
    }
    for (int n = 0; n < N; n += 3) {
        run(n, N - n < 3 ? N - n : 3, three);
    }
    budget = 1; // one 8-row block per group
    run(0, N, grouped);
    budget = kPackBudget;
    *identical = memcmp(all.data(), one.data(), all.size() * sizeof(float)) == 0 &&
                 memcmp(all.data(), three.data(), all.size() * sizeof(float)) == 0 &&
                 memcmp(all.data(), grouped.data(), all.size() * sizeof(float)) == 0;
    *paths = 1;
    if (has_vnni) {
        // The other instruction path (AVX2), batched and one row at a time, must give the
        // same bits.
        vnni = false;
        std::vector<float> other_all((size_t) N * M), other_one((size_t) N * M);
        run(0, N, other_all);
        for (int n = 0; n < N; n++) {
            run(n, 1, other_one);
        }
        vnni = true;
        *identical = *identical && memcmp(all.data(), other_all.data(), all.size() * sizeof(float)) == 0 &&
                     memcmp(all.data(), other_one.data(), all.size() * sizeof(float)) == 0;
        *paths = 2;
    }
    const auto vec_dot = ggml_get_type_traits_cpu(t)->vec_dot;
    double big = 0, diff = 0;
    for (int n = 0; n < N; n++) {
        for (int m = 0; m < M; m++) {
            float ref = 0;
            vec_dot(K, &ref, 0, wq.data() + m * wrow, 0, xq.data() + n * qrow, 0, 1);
            big = std::fmax(big, std::fabs(ref));
            diff = std::fmax(diff, std::fabs((double) ref - all[(size_t) n * M + m]));
        }
    }
    *max_rel = big > 0 ? diff / big : diff;
    return 0;
}

#else

const polykv_kernel * polykv_kq_kernel_for(const ggml_tensor *) { return nullptr; }

const polykv_kernel * polykv_kq_kernel(bool) { return nullptr; }

extern "C" int polykv_kq_model_choose(struct llama_model *, int) { return 1; }

extern "C" void polykv_kq_model_forget(struct llama_model *) {}

extern "C" unsigned long long polykv_kq_computed(void) { return 0; }

extern "C" int polykv_kq_available(void) { return 0; }

extern "C" int polykv_kq_vnni(void) { return 0; }

extern "C" int polykv_kq_selftest(int, int, int, int, unsigned, double *, int *, int *) { return -1; }

#endif
