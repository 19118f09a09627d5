// PolyKV's CPU matrix kernel for Q4_1, Q4_K and Q6_K weights, installed beside the
// flash-attention kernel through ggml-cpu's extra-buffer-type hook (fattn.cpp registers
// one extra that asks polykv_kq_traits here for MUL_MAT nodes).
//
// Why our own kernel: the ggml the ollama module vendors computes these products one
// (weight row, activation row) pair at a time (ggml_vec_dot_q4_K_q8_K etc.; llamafile's
// tiled sgemm covers Q4_0/Q5_0/Q8_0 but not these), unpacking the weights and their
// scales again for every token of a prompt batch. Newer llama.cpp tiles K-quants for
// batches of 8+ rows; ggml's "repack" layout groups rows by 4; both compute a row of a
// batch differently from a row alone, which would break PolyKV's promise that a token's
// logits do not depend on the batch (measured for repack: 0.214 in a logprob). This
// kernel unpacks each block of 8 weight rows once per product and reuses it for every
// activation row (the codes transposed so one 32-bit lane is one weight row).
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <vector>

#include "ggml-cpu/traits.h"
#include "ggml-cpu.h"

namespace {

constexpr int kRows = 8;  // weight rows per block: one lane each in a 256-bit register
constexpr int kCols = 4;  // activation rows computed together (sharing weight loads)
constexpr int kQK = 256;  // values per super-block
constexpr int kChunk = 64; // activation rows per pass over a thread's packed weights
// pack_budget is the bytes of packed weights a thread holds at once (the self-test
// lowers it to exercise the grouped path).
size_t pack_budget = 4 << 20;

// group_blocks is how many packed 8-row blocks of nsb blocks each fit the budget (at
// least one): a vocabulary-sized output matrix is packed a group at a time.
int64_t group_blocks(int64_t nsb, size_t packed) {
    const int64_t g = (int64_t) (pack_budget / ((size_t) nsb * packed));
    return g > 0 ? g : 1;
}

std::atomic<bool> enabled{false};
std::atomic<unsigned long long> computed{0};

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

// A packed block (256 values, or 32 for Q4_1) of kRows weight rows: the unsigned codes
// with row r's 4 consecutive values of group g at w[g][r] (so one 4-byte dot per lane is
// one row), the per-sub-block scales per row, int16 pairs for the min (Q4_K) or offset
// (Q6_K) term, and the block scales (d, and dmin or Q4_1's m).
template <class T>
struct packed {
    alignas(32) uint8_t w[T::kQK / 4][kRows][4];
    int32_t sc[T::kSub][kRows];
    int16_t mn[(T::kSub + 1) / 2][kRows][2];
    float d[kRows];
    float dmin[kRows];
};

// h2f converts an IEEE half to float (exact; inline, where ggml's is a library call).
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// dot4 adds, per 32-bit lane, the dot product of 4 unsigned weight codes and 4 signed
// activation values (exact in int32 either way).
inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, a);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, a);
#else
    // maddubs sums pairs into int16 without saturating: 2 x 63 x 128 < 32767.
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
#endif
}

// hsum4 and hsum8 add up the int32 lanes of a vector (exact).
inline int32_t hsum4(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
}

inline int32_t hsum8(__m256i v) { return hsum4(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))); }

// Type-specific unpacking of one super-block of one row: codes (0..15 or 0..63), the
// scale of each sub-block and the term subtracted per sub-block (min or 32 x scale).
struct kq4 {
    static constexpr int kQK = 256; // values per (super-)block
    static constexpr int kSub = 8;  // sub-blocks of 32
    static constexpr ggml_type kAct = GGML_TYPE_Q8_K;
    using block = q4k;
    using act = q8k;
    static float act_d(const act & a) { return a.d; }
    static void unpack(const block & x, uint8_t * q, int32_t * sc, int16_t * mn, float & d, float & dmin) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (x.qs + 32 * j));
            _mm256_storeu_si256((__m256i *) (q + 64 * j), _mm256_and_si256(v, m4));
            _mm256_storeu_si256((__m256i *) (q + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        const uint8_t * s = x.scales;
        for (int j = 0; j < kSub; j++) { // ggml's get_scale_min_k4
            if (j < 4) {
                sc[j] = s[j] & 63;
                mn[j] = s[j + 4] & 63;
            } else {
                sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            }
        }
        d = h2f(x.d);
        dmin = h2f(x.dmin);
    }
    // bpair is the activation sums of sub-blocks 2p and 2p+1 as an int16 pair.
    static int32_t bpair(const q8k & a, int p) {
        const int16_t b0 = (int16_t) (a.bsums[4 * p] + a.bsums[4 * p + 1]);
        const int16_t b1 = (int16_t) (a.bsums[4 * p + 2] + a.bsums[4 * p + 3]);
        return (int32_t) (uint16_t) b0 | ((int32_t) (uint16_t) b1 << 16);
    }
    // dot computes one row's integer sums for one super-block straight from the block
    // (the structure of ggml's AVX2 vec_dot_q4_K_q8_K, ending in integers).
    static void dot(const block & x, const q8k & a, int32_t & sumi, int32_t & summ) {
        uint32_t u[4];
        memcpy(u, x.scales, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t aux = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = aux;
        u[0] &= 0x3f3f3f3f;
        const uint8_t * sc = (const uint8_t *) &u[0]; // scales 0..7, then mins 0..7
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m256i bs = _mm256_loadu_si256((const __m256i *) a.bsums);
        const __m128i b32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        summ = hsum4(_mm_madd_epi16(_mm256_extracti128_si256(ms, 1), b32));
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        __m256i t = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (x.qs + 32 * j));
            const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(v, m4), _mm256_loadu_si256((const __m256i *) (a.qs + 64 * j)));
            const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_loadu_si256((const __m256i *) (a.qs + 64 * j + 32)));
            t = _mm256_add_epi32(t, _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(sc[2 * j])), _mm256_madd_epi16(hi, _mm256_set1_epi16(sc[2 * j + 1]))));
        }
        sumi = hsum8(t);
    }
};

struct kq6 {
    static constexpr int kQK = 256;
    static constexpr int kSub = 16; // sub-blocks of 16
    static constexpr ggml_type kAct = GGML_TYPE_Q8_K;
    using block = q6k;
    using act = q8k;
    static float act_d(const act & a) { return a.d; }
    // codes puts values [128n, 128n + 128) of the block in q[0..3], 32 each (ggml's
    // dequantize_row_q6_K order: 4 low bits from ql, 2 high bits from qh).
    static void codes(const block & x, int n, __m256i q[4]) {
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
        const __m256i l0 = _mm256_loadu_si256((const __m256i *) (x.ql + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *) (x.ql + 64 * n + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *) (x.qh + 32 * n));
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
    }
    static void unpack(const block & x, uint8_t * q, int32_t * sc, int16_t * mn, float & d, float & dmin) {
        for (int n = 0; n < 2; n++) {
            __m256i v[4];
            codes(x, n, v);
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_si256((__m256i *) (q + 128 * n + 32 * j), v[j]);
            }
        }
        for (int j = 0; j < kSub; j++) {
            sc[j] = x.scales[j];
            mn[j] = (int16_t) (32 * x.scales[j]); // codes are value + 32
        }
        d = h2f(x.d);
        dmin = 0;
    }
    static int32_t bpair(const q8k & a, int p) {
        return (int32_t) (uint16_t) a.bsums[2 * p] | ((int32_t) (uint16_t) a.bsums[2 * p + 1] << 16);
    }
    // dot computes one row's integer sums for one super-block straight from the block:
    // the codes (value + 32) times the activations, scaled per 16, and 32 x the scaled
    // activation sums.
    static void dot(const block & x, const q8k & a, int32_t & sumi, int32_t & summ) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *) x.scales);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        summ = 32 * hsum8(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *) a.bsums)));
        __m256i t = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            __m256i q[4];
            codes(x, n, q);
            for (int v = 0; v < 4; v++) {
                const int s0 = 8 * n + 2 * v; // the vector's two sub-blocks of 16: s0, s0 + 1
                const __m256i p = _mm256_maddubs_epi16(q[v], _mm256_loadu_si256((const __m256i *) (a.qs + 128 * n + 32 * v)));
                // scales s0 (low 8 lanes) and s0 + 1 (high 8 lanes), widened to int16
                const __m256i scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_set_epi64x(0x0101010101010101LL * (s0 + 1), 0x0101010101010101LL * s0)));
                t = _mm256_add_epi32(t, _mm256_madd_epi16(p, scv));
            }
        }
        sumi = hsum8(t);
    }
};

// Q4_1 (SmolLM2's weights): blocks of 32, value = d x code + m; with q8_1 activations
// a block's product is d x d_act x (codes . activations) + m x s_act.
struct kq41 {
    static constexpr int kQK = 32;
    static constexpr int kSub = 1;
    static constexpr ggml_type kAct = GGML_TYPE_Q8_1;
    using block = q41;
    using act = q81;
    static float act_d(const act & a) { return h2f(a.d); }
    // codes is the block's 32 codes (low nibbles are values 0..15, high ones 16..31).
    static __m256i codes(const block & x) {
        const __m128i v = _mm_loadu_si128((const __m128i *) x.qs);
        const __m128i m4 = _mm_set1_epi8(0x0F);
        return _mm256_setr_m128i(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    }
    static void unpack(const block & x, uint8_t * q, int32_t * sc, int16_t * mn, float & d, float & dmin) {
        _mm256_storeu_si256((__m256i *) q, codes(x));
        sc[0] = 1;
        mn[0] = 0;
        d = h2f(x.d);
        dmin = h2f(x.m);
    }
    static int32_t bpair(const act &, int) { return 0; }
    // (No row-wise dot: Q4_1's decode path is direct41, which reduces 8 rows at once.)
};

// transpose8 transposes an 8x8 matrix of 32-bit elements held in r[0..7].
inline void transpose8(__m256i r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_castsi256_ps(_mm256_unpacklo_epi32(r[i], r[i + 1]));
        t[i + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi32(r[i], r[i + 1]));
    }
    u[0] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0));
    u[1] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2));
    u[2] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0));
    u[3] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2));
    u[4] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(1, 0, 1, 0));
    u[5] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(3, 2, 3, 2));
    u[6] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(1, 0, 1, 0));
    u[7] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(3, 2, 3, 2));
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// pack unpacks n (<= kRows) weight rows of nsb super-blocks into out[nsb]; missing rows
// are zero (their lanes compute zeros that are never stored).
template <class T>
void pack(const char * rows, size_t stride, int n, int64_t nsb, packed<T> * out) {
    alignas(32) uint8_t q[kRows][T::kQK];
    for (int64_t b = 0; b < nsb; b++) {
        packed<T> & p = out[b];
        int32_t sc[T::kSub];
        int16_t mn[T::kSub + 1];
        for (int r = 0; r < kRows; r++) {
            if (r < n) {
                const auto & x = ((const typename T::block *) (rows + r * stride))[b];
                T::unpack(x, q[r], sc, mn, p.d[r], p.dmin[r]);
            } else {
                memset(q[r], 0, T::kQK);
                memset(sc, 0, sizeof(sc));
                memset(mn, 0, sizeof(mn));
                p.d[r] = p.dmin[r] = 0;
            }
            for (int j = 0; j < T::kSub; j++) {
                p.sc[j][r] = sc[j];
            }
            for (int j = 0; j < T::kSub / 2; j++) {
                p.mn[j][r][0] = mn[2 * j];
                p.mn[j][r][1] = mn[2 * j + 1];
            }
        }
        // Row r's bytes [32i, 32i+32) are groups 8i..8i+7 of row r: transposing the 8x8
        // matrix of 4-byte groups puts group g of every row in one register.
        for (int i = 0; i < T::kQK / 32; i++) {
            __m256i t[8];
            for (int r = 0; r < kRows; r++) {
                t[r] = _mm256_load_si256((const __m256i *) (q[r] + 32 * i));
            }
            transpose8(t);
            for (int j = 0; j < 8; j++) {
                _mm256_store_si256((__m256i *) p.w[8 * i + j], t[j]);
            }
        }
    }
}


// finish adds one super-block's integer sums to the float accumulators of kRows rows
// (one lane each): the only float arithmetic of the kernel, shared by tile and direct so
// a row's result is the same bits whichever computes it.
template <class T>
inline __m256 finish(__m256 acc, const typename T::act & a, __m256 D, __m256 M, __m256i sumi, __m256i summ) {
    const __m256 da = _mm256_set1_ps(T::act_d(a));
    if constexpr (T::kQK == 32) { // Q4_1: d x d_act x dot + m x s_act
        acc = _mm256_fmadd_ps(_mm256_mul_ps(da, D), _mm256_cvtepi32_ps(sumi), acc);
        return _mm256_fmadd_ps(M, _mm256_set1_ps(h2f(a.s)), acc);
    } else if constexpr (T::kSub == 8) { // Q4_K: d x scaled sum - dmin x min sum
        acc = _mm256_fmadd_ps(_mm256_mul_ps(da, D), _mm256_cvtepi32_ps(sumi), acc);
        return _mm256_fnmadd_ps(_mm256_mul_ps(da, M), _mm256_cvtepi32_ps(summ), acc);
    } else { // Q6_K: d x (scaled sum of codes - 32 x scaled activation sums)
        return _mm256_fmadd_ps(_mm256_mul_ps(da, D), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, summ)), acc);
    }
}

// store writes the first n of kRows row results.
inline void store(float * out, __m256 v, int n) {
    if (n == kRows) {
        _mm256_storeu_ps(out, v);
    } else {
        alignas(32) float t[kRows];
        _mm256_store_ps(t, v);
        memcpy(out, t, n * sizeof(float));
    }
}

// tile computes kRows weight rows (packed) times C activation rows over nsb
// super-blocks; out[c] receives n row results.
template <class T, int C>
void tile(const packed<T> * p, int64_t nsb, const typename T::act * const a[C], float * const out[C], int n) {
    constexpr int SB = T::kQK / T::kSub; // values per sub-block
    __m256 acc[C];
    for (int c = 0; c < C; c++) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++) {
        const packed<T> & P = p[b];
        __m256i sumi[C], summ[C];
        for (int c = 0; c < C; c++) {
            sumi[c] = summ[c] = _mm256_setzero_si256();
        }
        if constexpr (T::kSub == 1) {
            // One sub-block (Q4_1): even and odd groups in two chains, added (exact).
            __m256i d0[C], d1[C];
            for (int c = 0; c < C; c++) {
                d0[c] = d1[c] = _mm256_setzero_si256();
            }
            for (int g = 0; g < SB / 4; g += 2) {
                const __m256i w0 = _mm256_load_si256((const __m256i *) P.w[g]);
                const __m256i w1 = _mm256_load_si256((const __m256i *) P.w[g + 1]);
                for (int c = 0; c < C; c++) {
                    int32_t a0, a1;
                    memcpy(&a0, a[c][b].qs + 4 * g, 4);
                    memcpy(&a1, a[c][b].qs + 4 * g + 4, 4);
                    d0[c] = dot4(d0[c], w0, _mm256_set1_epi32(a0));
                    d1[c] = dot4(d1[c], w1, _mm256_set1_epi32(a1));
                }
            }
            for (int c = 0; c < C; c++) {
                sumi[c] = _mm256_add_epi32(d0[c], d1[c]);
            }
        } else {
            // Two sub-blocks at a time: two independent dot chains per activation row, so
            // even one row is not bound by the dot instruction's latency.
            for (int s = 0; s < T::kSub; s += 2) {
                __m256i d0[C], d1[C];
                for (int c = 0; c < C; c++) {
                    d0[c] = d1[c] = _mm256_setzero_si256();
                }
                for (int g = 0; g < SB / 4; g++) {
                    const __m256i w0 = _mm256_load_si256((const __m256i *) P.w[s * SB / 4 + g]);
                    const __m256i w1 = _mm256_load_si256((const __m256i *) P.w[(s + 1) * SB / 4 + g]);
                    for (int c = 0; c < C; c++) {
                        int32_t a0, a1;
                        memcpy(&a0, a[c][b].qs + s * SB + 4 * g, 4);
                        memcpy(&a1, a[c][b].qs + (s + 1) * SB + 4 * g, 4);
                        d0[c] = dot4(d0[c], w0, _mm256_set1_epi32(a0));
                        d1[c] = dot4(d1[c], w1, _mm256_set1_epi32(a1));
                    }
                }
                const __m256i sc0 = _mm256_loadu_si256((const __m256i *) P.sc[s]);
                const __m256i sc1 = _mm256_loadu_si256((const __m256i *) P.sc[s + 1]);
                for (int c = 0; c < C; c++) {
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(_mm256_mullo_epi32(d0[c], sc0), _mm256_mullo_epi32(d1[c], sc1)));
                }
            }
        }
        for (int j = 0; j < T::kSub / 2; j++) {
            const __m256i mn = _mm256_loadu_si256((const __m256i *) P.mn[j]);
            for (int c = 0; c < C; c++) {
                summ[c] = _mm256_add_epi32(summ[c], _mm256_madd_epi16(mn, _mm256_set1_epi32(T::bpair(a[c][b], j))));
            }
        }
        const __m256 D = _mm256_loadu_ps(P.d), M = _mm256_loadu_ps(P.dmin);
        for (int c = 0; c < C; c++) {
            acc[c] = finish<T>(acc[c], a[c][b], D, M, sumi[c], summ[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        store(out[c], acc[c], n);
    }
}

// direct computes kRows weight rows (n of them real) times C (1-3) activation rows
// without packing: for a decode step packing costs more than it saves. Each row's
// integer sums are computed row-wise (exact, so equal to tile's), one row after the
// other (sequential reads, as ggml's vec_dot walks them), into scratch; then the same
// float sequence as tile (finish) in the same lanes.
template <class T, int C>
void direct(const char * rows, size_t stride, int n, int64_t nsb, const typename T::act * const a[C], float * const out[C], void * scratch) {
    int32_t * si = (int32_t *) scratch;          // [C][nsb][kRows]
    int32_t * sm = si + C * nsb * kRows;         // [C][nsb][kRows]
    float * d = (float *) (sm + C * nsb * kRows); // [nsb][kRows]
    float * dmin = d + nsb * kRows;              // [nsb][kRows]
    if (n < kRows) {
        memset(scratch, 0, (size_t) (2 * C + 2) * nsb * kRows * 4);
    }
    for (int r = 0; r < n; r++) {
        const auto * x = (const typename T::block *) (rows + r * stride);
        for (int64_t b = 0; b < nsb; b++) {
            d[b * kRows + r] = h2f(x[b].d);
            if constexpr (T::kQK == 32) {
                dmin[b * kRows + r] = h2f(x[b].m);
            } else if constexpr (T::kSub == 8) {
                dmin[b * kRows + r] = h2f(x[b].dmin);
            } else {
                dmin[b * kRows + r] = 0;
            }
            for (int c = 0; c < C; c++) {
                T::dot(x[b], a[c][b], si[(c * nsb + b) * kRows + r], sm[(c * nsb + b) * kRows + r]);
            }
        }
    }
    __m256 acc[C];
    for (int c = 0; c < C; c++) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++) {
        const __m256 D = _mm256_loadu_ps(d + b * kRows), M = _mm256_loadu_ps(dmin + b * kRows);
        for (int c = 0; c < C; c++) {
            acc[c] = finish<T>(acc[c], a[c][b], D, M, _mm256_loadu_si256((const __m256i *) (si + (c * nsb + b) * kRows)),
                               _mm256_loadu_si256((const __m256i *) (sm + (c * nsb + b) * kRows)));
        }
    }
    for (int c = 0; c < C; c++) {
        store(out[c], acc[c], n);
    }
}

// reduce8 sums each of t[0..7] across its lanes: lane r of the result is the sum of t[r]
// (exact in int32).
inline __m256i reduce8(const __m256i t[8]) {
    const __m256i s0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    const __m256i s4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20), _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// direct41 is direct for Q4_1, whose 32-value blocks are too small to pay for a pass
// through scratch: each block's 8 rows are reduced together (reduce8) and finished at
// once, the same float sequence as tile's.
template <int C>
void direct41(const char * rows, size_t stride, int n, int64_t nsb, const q81 * const a[C], float * const out[C]) {
    __m256 acc[C];
    for (int c = 0; c < C; c++) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++) {
        alignas(32) float d[kRows] = {}, m[kRows] = {};
        __m256i t[C][kRows];
        for (int r = 0; r < kRows; r++) {
            if (r >= n) {
                for (int c = 0; c < C; c++) {
                    t[c][r] = _mm256_setzero_si256();
                }
                continue;
            }
            const q41 & x = ((const q41 *) (rows + r * stride))[b];
            // Eight rows are read side by side: fetch ahead, as a lone stream would be.
            _mm_prefetch((const char *) (&x + 8), _MM_HINT_T0);
            d[r] = h2f(x.d);
            m[r] = h2f(x.m);
            const __m256i q = kq41::codes(x);
            for (int c = 0; c < C; c++) {
                t[c][r] = dot4(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *) a[c][b].qs));
            }
        }
        const __m256 D = _mm256_load_ps(d), M = _mm256_load_ps(m);
        for (int c = 0; c < C; c++) {
            acc[c] = finish<kq41>(acc[c], a[c][b], D, M, reduce8(t[c]), _mm256_setzero_si256());
        }
    }
    for (int c = 0; c < C; c++) {
        store(out[c], acc[c], n);
    }
}

// rows computes weight rows [r0, r1) (a thread's share, r0 a multiple of kRows) times
// all N activation rows, with scratch for the packed blocks.
template <class T>
void rows(const char * w, size_t wstride, int64_t r0, int64_t r1, int64_t K, const char * act, size_t astride, int64_t N,
          char * dst, size_t dstride, void * scratch) {
    const int64_t nsb = K / T::kQK;
    auto * P = (packed<T> *) scratch;
    const int64_t nblk = (r1 - r0 + kRows - 1) / kRows;
    auto block_rows = [&](int64_t i) { return (int) (r1 - (r0 + i * kRows) < kRows ? r1 - (r0 + i * kRows) : kRows); };
    // cols computes packed block i (at pb) times activation rows [c0, c1).
    using act_t = typename T::act;
    auto cols = [&](int64_t i, const packed<T> * pb, int64_t c0, int64_t c1) {
        const int64_t rb = r0 + i * kRows;
        const act_t * a[kCols];
        float * o[kCols];
        for (int64_t c = c0; c < c1; c += kCols) {
            const int m = (int) (c1 - c < kCols ? c1 - c : kCols);
            for (int j = 0; j < m; j++) {
                a[j] = (const act_t *) (act + (c + j) * astride);
                o[j] = (float *) (dst + (c + j) * dstride) + rb;
            }
            switch (m) {
            case 1: tile<T, 1>(pb, nsb, a, o, block_rows(i)); break;
            case 2: tile<T, 2>(pb, nsb, a, o, block_rows(i)); break;
            case 3: tile<T, 3>(pb, nsb, a, o, block_rows(i)); break;
            default: tile<T, 4>(pb, nsb, a, o, block_rows(i)); break;
            }
        }
    };
    if (N < kCols) { // a decode step (or two, three): no packing
        const act_t * a[kCols];
        for (int64_t i = 0; i < nblk; i++) {
            const int64_t rb = r0 + i * kRows;
            float * o[kCols];
            for (int j = 0; j < N; j++) {
                a[j] = (const act_t *) (act + j * astride);
                o[j] = (float *) (dst + j * dstride) + rb;
            }
            if constexpr (T::kQK == 32) {
                switch (N) {
                case 1: direct41<1>(w + rb * wstride, wstride, block_rows(i), nsb, a, o); break;
                case 2: direct41<2>(w + rb * wstride, wstride, block_rows(i), nsb, a, o); break;
                default: direct41<3>(w + rb * wstride, wstride, block_rows(i), nsb, a, o); break;
                }
            } else {
                switch (N) {
                case 1: direct<T, 1>(w + rb * wstride, wstride, block_rows(i), nsb, a, o, scratch); break;
                case 2: direct<T, 2>(w + rb * wstride, wstride, block_rows(i), nsb, a, o, scratch); break;
                default: direct<T, 3>(w + rb * wstride, wstride, block_rows(i), nsb, a, o, scratch); break;
                }
            }
        }
        return;
    }
    if (N <= kChunk) { // few activation rows: pack a block, use it, reuse the scratch
        for (int64_t i = 0; i < nblk; i++) {
            pack<T>(w + (r0 + i * kRows) * wstride, wstride, block_rows(i), nsb, P);
            cols(i, P, 0, N);
        }
        return;
    }
    // A prompt batch: pack a group of the thread's row blocks (all of them unless the
    // matrix is huge) once, then walk the activation rows in chunks so a chunk stays in
    // cache while the packed blocks stream past it.
    const int64_t group = group_blocks(nsb, sizeof(packed<T>));
    for (int64_t g0 = 0; g0 < nblk; g0 += group) {
        const int64_t g1 = g0 + group < nblk ? g0 + group : nblk;
        for (int64_t i = g0; i < g1; i++) {
            pack<T>(w + (r0 + i * kRows) * wstride, wstride, block_rows(i), nsb, P + (i - g0) * nsb);
        }
        for (int64_t c0 = 0; c0 < N; c0 += kChunk) {
            for (int64_t i = g0; i < g1; i++) {
                cols(i, P + (i - g0) * nsb, c0, c0 + kChunk < N ? c0 + kChunk : N);
            }
        }
    }
}

size_t packed_bytes(ggml_type t) {
    switch (t) {
    case GGML_TYPE_Q4_K: return sizeof(packed<kq4>);
    case GGML_TYPE_Q6_K: return sizeof(packed<kq6>);
    default: return sizeof(packed<kq41>);
    }
}

// block_values is how many values one weight block holds (the kernel's unit along K).
int64_t block_values(ggml_type t) { return t == GGML_TYPE_Q4_1 ? kq41::kQK : kQK; }

// act_type is the type the activation rows are quantized to for weight type t.
ggml_type act_type(ggml_type t) { return t == GGML_TYPE_Q4_1 ? kq41::kAct : kq4::kAct; }

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
size_t scratch_bytes(ggml_type t, int64_t M, int64_t K, int64_t N, int nth) {
    const int64_t nblk = (M + kRows - 1) / kRows;
    const int64_t most = (nblk + nth - 1) / nth;
    const int64_t nsb = K / block_values(t);
    const int64_t held = N < kCols ? 0 : N <= kChunk ? 1 : std::min(most, group_blocks(nsb, packed_bytes(t)));
    const size_t packs = (size_t) held * nsb * packed_bytes(t);
    const size_t direct_sums = (size_t) (2 * (kCols - 1) + 2) * nsb * kRows * 4; // direct's integer sums and scales
    return (packs > direct_sums ? packs : direct_sums) + 64;
}

void compute(ggml_type t, const char * w, size_t wstride, int64_t r0, int64_t r1, int64_t K, const char * act, size_t astride, int64_t N,
             char * dst, size_t dstride, void * scratch) {
    switch (t) {
    case GGML_TYPE_Q4_K: rows<kq4>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch); break;
    case GGML_TYPE_Q6_K: rows<kq6>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch); break;
    default: rows<kq41>(w, wstride, r0, r1, K, act, astride, N, dst, dstride, scratch); break;
    }
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
    const size_t per = (scratch_bytes(w->type, w->ne[1], w->ne[0], x->ne[1], nth) + 63) & ~(size_t) 63;
    return 64 + q8 + per * nth;
}

class traits : public ggml::cpu::tensor_traits {
  public:
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size = work_bytes(op, n_threads);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        const ggml_tensor * w = op->src[0], * x = op->src[1];
        const int ith = params->ith, nth = params->nth;
        if (params->wsize < work_bytes(op, nth)) {
            return false; // planned without us (enabled mid-graph): ggml's kernel
        }
        const int64_t K = w->ne[0], M = w->ne[1], N = x->ne[1];
        char * base = (char *) (((uintptr_t) params->wdata + 63) & ~(uintptr_t) 63);
        const size_t qrow = act_row_bytes(w->type, K);
        const size_t q8 = (qrow * N + 63) & ~(size_t) 63;
        const size_t per = (scratch_bytes(w->type, M, K, N, nth) + 63) & ~(size_t) 63;
        // Phase 1: the activation rows to q8_K or q8_1 (ggml's own quantizer, so a row's
        // quantization is a function of the row alone), split among threads.
        const ggml_from_float_t quantize = ggml_get_type_traits_cpu(act_type(w->type))->from_float;
        for (int64_t n = ith; n < N; n += nth) {
            quantize((const float *) ((const char *) x->data + n * x->nb[1]), base + n * qrow, K);
        }
        if (ith == 0) {
            computed.fetch_add(1, std::memory_order_relaxed);
        }
        ggml_barrier(params->threadpool);
        // Phase 2: each thread its contiguous share of weight rows, all activation rows.
        int64_t r0, r1;
        thread_rows(M, ith, nth, r0, r1);
        if (r0 < r1) {
            compute(w->type, (const char *) w->data, w->nb[1], r0, r1, K, base, qrow, N, (char *) op->data, op->nb[1],
                    base + q8 + per * ith);
        }
        return true;
    }
};

}  // namespace

ggml::cpu::tensor_traits * polykv_kq_traits(const ggml_tensor * op) {
    static traits t;
    return enabled.load(std::memory_order_relaxed) && supported(op) ? &t : nullptr;
}

extern "C" void polykv_kq_enable(int on) { enabled.store(on != 0); }

extern "C" unsigned long long polykv_kq_computed(void) { return computed.load(); }

extern "C" int polykv_kq_available(void) { return 1; }

// polykv_kq_selftest quantizes a random M x K matrix to type and N random activation
// rows (q8_K or q8_1), computes the product with this kernel for all N rows at once, for
// each row alone, for the rows in groups of 3 and all at once packing one 8-row block at
// a time, and with ggml's vec_dot. It reports the largest difference from ggml relative
// to the largest |result|, and whether the four kernel runs agree bit for bit.
extern "C" int polykv_kq_selftest(int type, int M, int K, int N, unsigned seed, double * max_rel, int * identical) {
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
    auto run = [&](int64_t c0, int64_t cn, std::vector<float> & out) {
        for (int ith = 0; ith < 2; ith++) {
            int64_t r0, r1;
            thread_rows(M, ith, 2, r0, r1);
            if (r0 >= r1) {
                continue;
            }
            void * s = aligned_alloc(64, (scratch_bytes(t, M, K, cn, 2) + 63) & ~(size_t) 63);
            compute(t, wq.data(), wrow, r0, r1, K, xq.data() + c0 * qrow, qrow, cn, (char *) (out.data() + c0 * M), M * sizeof(float), s);
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
    const size_t budget = pack_budget;
    pack_budget = 1; // one 8-row block per group
    run(0, N, grouped);
    pack_budget = budget;
    *identical = memcmp(all.data(), one.data(), all.size() * sizeof(float)) == 0 &&
                 memcmp(all.data(), three.data(), all.size() * sizeof(float)) == 0 &&
                 memcmp(all.data(), grouped.data(), all.size() * sizeof(float)) == 0;
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

ggml::cpu::tensor_traits * polykv_kq_traits(const ggml_tensor *) { return nullptr; }

extern "C" void polykv_kq_enable(int on) { (void) on; }

extern "C" unsigned long long polykv_kq_computed(void) { return 0; }

extern "C" int polykv_kq_available(void) { return 0; }

extern "C" int polykv_kq_selftest(int, int, int, int, unsigned, double *, int *) { return -1; }

#endif
