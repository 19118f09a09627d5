// PolyKV's CPU flash-attention kernel for f16 K/V caches, installed into ggml-cpu
// through its "extra buffer type" hook (ggml_cpu_extra_compute_forward asks every
// registered extra for tensor traits before running an op's stock kernel; internals.cpp
// registers the hook, and polykv_kernel_for below says which of PolyKV's kernels, if any,
// computes a node).
//
// Why our own kernel: it was written when PolyKV linked the llama.cpp the ollama Go module
// vendored (ec98e2002), whose ggml computed flash attention one query row at a time (per
// cell: an f16 dot product with a horizontal sum, a scalar expf and an f16 accumulator
// converted back and forth), ~0.7x of newer llama.cpp's tiled kernel on a 2,000-token
// prefill. PolyKV now links the pinned release (llama.cpp.pin, b11434), which has that
// tiled kernel; this one stays for what ggml's does not give: a token's logits that do
// not depend on the batch or on where its cells sit, without compacting the cache (below;
// docs/benchmarks.md measures both kernels on b11434). It shares each K/V tile among up
// to eight query rows of the same KV head (transposed and converted to f32 once), keeps
// the accumulator in f32 and vectorizes the exponentials.
//
// Why it keeps a token's logits independent of the batch and of other traffic
// (PolyKV's determinism promise): every output is a fixed function of the query row and
// the list of cells its mask lets through, *in position order*, whatever else is in the
// batch or the cache and wherever llama.cpp placed the cells:
// - a score is one FMA chain over the head dimensions in order (d = 0, 1, ...), in one
//   SIMD lane, whichever tile, lane or row block computes it;
// - the softmax is exact two-pass: the maximum over unmasked scores (order-free), then
//   exp(s - max) per cell, then the sum and the weighted V rows accumulated cell by cell
//   in position order (cellorder.cpp reads the positions from llama.cpp's KV cells), so
//   a sequence whose next cells landed in a hole below its older ones sums exactly as on
//   a quiet server, with no compaction of the cache.
// Why its cost follows a query's own context, not the cache's fill: each block visits
// only the cells its rows see (runs found once per mask row and graph, see
// traits::visible), as paged attention's block tables do; other sequences' cells are
// never loaded.
// Caches: f16, f32, q8_0 and q4_0 (K and V of one type). The stock kernel is used for
// everything else (other or mixed cache types, ALiBi, logit softcap, head sizes over 256,
// CPUs without AVX2/FMA); there PolyKV still compacts the cache.

#include "fattn.h"
#include "kquant.h"
#include "cellorder.h"
#include "internals.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <atomic>
#include <unordered_map>
#include <vector>

#include "ggml.h"

namespace {

// fp16_to_fp32 converts exactly, as ggml-cpu's GGML_CPU_FP16_TO_FP32 does (with F16C by
// the same instruction).
inline float fp16_to_fp32(ggml_fp16_t x) {
#ifdef __F16C__
    return _cvtsh_ss(x);
#else
    return ggml_fp16_to_fp32(x);
#endif
}

constexpr int kRows = 8;    // query rows sharing one K/V tile
constexpr int kTile = 8;    // cells per tile (one AVX2 register of scores)
constexpr int kMaxD = 576;  // largest head size handled (576: MLA, whose K row is the 512-wide latent and a 64-wide rope part)

std::atomic<unsigned long long> computed{0}; // flash-attention nodes this kernel ran
std::atomic<unsigned long long> ordered{0};  // of those, nodes of a registered cache (position order)
std::atomic<unsigned long long> skipped{0};  // f32-to-f16 casts of cache views left uncomputed

struct geometry {
    int64_t DK, DV, N, nkv, nq2, nq3, rk2, rk3;
};

// cache_view is the K or V a flash-attention node reads, seen through llama.cpp's cast of
// an f32 cache view to f16 (see cellorder.h): this kernel reads the f32 view itself, so
// the cast's output is never needed (and its copy is skipped: traits::get_tensor_traits).
const ggml_tensor * cache_view(const ggml_tensor * t) {
    if (t->op == GGML_OP_CPY && t->type == GGML_TYPE_F16 && t->src[0] != nullptr && t->src[0]->type == GGML_TYPE_F32 &&
        ggml_are_same_shape(t, t->src[0])) {
        return t->src[0];
    }
    return t;
}

// supported reports whether op is a flash-attention node this kernel computes.
bool supported(const ggml_tensor * op) {
    if (op->op != GGML_OP_FLASH_ATTN_EXT) {
        return false;
    }
    const ggml_tensor * q = op->src[0], * k = cache_view(op->src[1]), * v = cache_view(op->src[2]), * mask = op->src[3], * sinks = op->src[4];
    float max_bias = 0, softcap = 0;
    memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
    memcpy(&softcap, (const float *) op->op_params + 2, sizeof(float));
    if (max_bias != 0 || softcap != 0) {
        return false;
    }
    if (q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32 || k->type != v->type ||
        (k->type != GGML_TYPE_F16 && k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_Q8_0 && k->type != GGML_TYPE_Q4_0)) {
        return false;
    }
    if (ggml_is_quantized(k->type) && (k->ne[0] % 32 != 0 || v->ne[0] % 32 != 0)) {
        return false; // rows of whole 32-value blocks
    }
    if (mask && mask->type != GGML_TYPE_F16) {
        return false;
    }
    if (sinks && sinks->type != GGML_TYPE_F32) {
        return false;
    }
    const int64_t DK = k->ne[0], DV = v->ne[0];
    if (DK % kTile != 0 || DV % kTile != 0 || DK > kMaxD || DV > kMaxD || q->ne[0] != DK) {
        return false;
    }
    // Rows contiguous, dst not permuted, heads broadcast evenly (as the stock kernel asserts).
    if (q->nb[0] != sizeof(float) || k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type) || op->nb[0] != sizeof(float)) {
        return false;
    }
    if (k->ne[2] != v->ne[2] || k->ne[3] != v->ne[3] || k->ne[1] != v->ne[1]) {
        return false;
    }
    if (q->ne[2] % k->ne[2] != 0 || q->ne[3] % k->ne[3] != 0) {
        return false;
    }
    return true;
}

geometry shape(const ggml_tensor * op) {
    const ggml_tensor * q = op->src[0], * k = cache_view(op->src[1]), * v = cache_view(op->src[2]);
    return geometry{k->ne[0], v->ne[0], q->ne[1], k->ne[1], q->ne[2], q->ne[3], q->ne[2] / k->ne[2], q->ne[3] / k->ne[3]};
}

// scratch floats per thread: scores for kRows rows over all cells, the transposed K tile,
// kRows accumulators, and slack for alignment.
size_t scratch_floats(const geometry & g) {
    return (size_t) kRows * (g.nkv + 2 * kTile) + (size_t) kMaxD * 2 * kTile + (size_t) kRows * kMaxD + 64;
}

// The quantized cache rows this kernel reads, as ggml lays them out (ggml-common.h):
// 32 values per block, an f16 scale d, then the codes.
struct q8_block { // value j = d * qs[j]
    ggml_fp16_t d;
    int8_t      qs[32];
};
struct q4_block { // value j = d * ((qs[j % 16] >> (4 * (j / 16))) & 15) - 8)
    ggml_fp16_t d;
    uint8_t     qs[16];
};
static_assert(sizeof(q8_block) == 34 && sizeof(q4_block) == 18, "ggml's q8_0 / q4_0 block layout");

// row8 loads dims [d0, d0+8) of one cache row as f32 (d0 a multiple of 8). A quantized
// value is d * code in f32, exactly what dequantizing the row first would give.
inline __m256 row8(const ggml_fp16_t * r, int64_t d0) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (r + d0))); }
inline __m256 row8(const float * r, int64_t d0) { return _mm256_loadu_ps(r + d0); }
inline __m256 row8(const q8_block * r, int64_t d0) {
    const q8_block & b = r[d0 / 32];
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (b.qs + d0 % 32)));
    return _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(b.d)), _mm256_cvtepi32_ps(q));
}
inline __m256 row8(const q4_block * r, int64_t d0) {
    const q4_block & b = r[d0 / 32];
    const int off = (int) (d0 % 32);
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (b.qs + off % 16)));
    q = _mm256_and_si256(_mm256_srli_epi32(q, off < 16 ? 0 : 4), _mm256_set1_epi32(15));
    q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    return _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(b.d)), _mm256_cvtepi32_ps(q));
}

// load_tile converts the dims [d0, d0+8) of up to kTile cells (rows at r[0..n)) to f32
// and transposes them: out[j] holds dim d0+j of cells 0..7 (cells past n are zero).
template <typename T>
inline void load_tile(const T * const * rp, int n, int64_t d0, __m256 out[8]) {
    __m256 r[8];
    for (int c = 0; c < 8; c++) {
        r[c] = c < n ? row8(rp[c], d0) : _mm256_setzero_ps();
    }
    // 8x8 transpose.
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    out[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    out[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    out[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    out[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// accumulate adds p[c] * vt[c] for NC cells, all visible, to NV vectors at a, in cell
// order. (Hidden cells are skipped rather than multiplied by 0: V of a cell outside the
// sequence may be anything, and 0 * inf is NaN.)
template <int NV, int NC>
inline void accumulate(float * a, const float * p, const float * vt, int64_t ldv) {
    __m256 x[NV];
    for (int j = 0; j < NV; j++) {
        x[j] = _mm256_loadu_ps(a + 8 * j);
    }
    for (int c = 0; c < NC; c++) {
        const __m256 pc = _mm256_set1_ps(p[c]);
        for (int j = 0; j < NV; j++) {
            x[j] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vt + c * ldv + 8 * j), x[j]);
        }
    }
    for (int j = 0; j < NV; j++) {
        _mm256_storeu_ps(a + 8 * j, x[j]);
    }
}

// accumulate_some is accumulate for a tile with hidden cells (p < 0) or fewer cells or
// vectors; the same FMAs in the same order for the cells it adds.
inline void accumulate_some(float * a, const float * p, int n, const float * vt, int64_t ldv, int nv) {
    __m256 x[8];
    for (int j = 0; j < nv; j++) {
        x[j] = _mm256_loadu_ps(a + 8 * j);
    }
    for (int c = 0; c < n; c++) {
        if (p[c] < 0.0f) {
            continue;
        }
        const __m256 pc = _mm256_set1_ps(p[c]);
        for (int j = 0; j < nv; j++) {
            x[j] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vt + c * ldv + 8 * j), x[j]);
        }
    }
    for (int j = 0; j < nv; j++) {
        _mm256_storeu_ps(a + 8 * j, x[j]);
    }
}

// block computes up to kRows query rows that share one KV head, over the cells
// idx[0..nu) in that order (the rows' visible cells in position order; a row's mask
// hides the others). nr is a template parameter so the per-row loops unroll and the
// accumulators stay in registers; T is the cache's element type (f16 or f32).
template <int nr, typename T>
void block(const ggml_tensor * op, const geometry & g, const int64_t * rows, float * wd, const uint32_t * idx, int64_t nu) {
    const ggml_tensor * q = op->src[0], * k = cache_view(op->src[1]), * v = cache_view(op->src[2]), * mask = op->src[3], * sinks = op->src[4];
    float scale = 1;
    memcpy(&scale, (const float *) op->op_params + 0, sizeof(float));

    float * sc = wd;                                  // [kRows][nu + 2 * kTile]
    float * kt = sc + (size_t) kRows * (g.nkv + 2 * kTile); // [DK][2 * kTile]
    float * acc = kt + (size_t) kMaxD * 2 * kTile;      // [kRows][DV]
    const int64_t ldsc = nu + 2 * kTile;

    const float * qr[kRows];
    const ggml_fp16_t * mr[kRows];
    int64_t iq1[kRows], iq2[kRows], iq3[kRows];
    for (int r = 0; r < nr; r++) {
        const int64_t ir = rows[r];
        iq3[r] = ir / (g.nq2 * g.N);
        iq2[r] = (ir - iq3[r] * g.nq2 * g.N) / g.N;
        iq1[r] = ir - iq3[r] * g.nq2 * g.N - iq2[r] * g.N;
        qr[r] = (const float *) ((const char *) q->data + iq1[r] * q->nb[1] + iq2[r] * q->nb[2] + iq3[r] * q->nb[3]);
        mr[r] = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1[r] * mask->nb[1] + (iq2[r] % mask->ne[2]) * mask->nb[2] +
                                              (iq3[r] % mask->ne[3]) * mask->nb[3])
                     : nullptr;
    }
    const int64_t ik2 = iq2[0] / g.rk2, ik3 = iq3[0] / g.rk3;
    const char * kbase = (const char *) k->data + ik2 * k->nb[2] + ik3 * k->nb[3];
    const char * vbase = (const char *) v->data + ik2 * v->nb[2] + ik3 * v->nb[3];
    const size_t kstride = k->nb[1], vstride = v->nb[1];
    const size_t krow_bytes = ggml_row_size(k->type, g.DK), vrow_bytes = ggml_row_size(v->type, g.DV);
    auto krow = [&](int64_t u) { return (const T *) (kbase + (size_t) idx[u] * kstride); };
    auto vrow = [&](int64_t u) { return (const T *) (vbase + (size_t) idx[u] * vstride); };

    // Pass 1: scores, -inf where the mask (or the end of the list) hides a cell.
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 vscale = _mm256_set1_ps(scale);
    float mrow[kRows];
    for (int r = 0; r < nr; r++) {
        mrow[r] = -INFINITY;
    }
    // Two tiles (16 cells) per step: with four rows that is eight independent FMA chains,
    // enough to hide the FMA latency.
    __m256 mx[kRows];
    for (int r = 0; r < kRows; r++) {
        mx[r] = ninf;
    }
    for (int64_t c0 = 0; c0 < nu; c0 += 2 * kTile) {
        int n[2];
        __m256 m[kRows][2];
        bool any[2] = {false, false};
        for (int h = 0; h < 2; h++) {
            const int64_t left = nu - (c0 + h * kTile);
            n[h] = (int) (left <= 0 ? 0 : left < kTile ? left : kTile);
            for (int r = 0; r < nr; r++) {
                float mv[kTile];
                for (int c = 0; c < kTile; c++) {
                    mv[c] = c < n[h] ? (mr[r] ? fp16_to_fp32(mr[r][idx[c0 + h * kTile + c]]) : 0.0f) : -INFINITY;
                }
                m[r][h] = _mm256_loadu_ps(mv);
                any[h] = any[h] || _mm256_movemask_ps(_mm256_cmp_ps(m[r][h], ninf, _CMP_NEQ_OQ)) != 0;
            }
        }
        // Decode steps read K from memory once per step and layer: fetch two tiles ahead.
        for (int c = 0; c < 2 * kTile && c0 + 4 * kTile + c < nu; c++) {
            const char * kr = (const char *) krow(c0 + 4 * kTile + c);
            for (int64_t o = 0; o < (int64_t) krow_bytes; o += 64) {
                _mm_prefetch(kr + o, _MM_HINT_T0);
            }
        }
        if (!any[0] && !any[1]) {
            for (int r = 0; r < nr; r++) {
                _mm256_storeu_ps(sc + r * ldsc + c0, ninf);
                _mm256_storeu_ps(sc + r * ldsc + c0 + kTile, ninf);
            }
            continue;
        }
        for (int h = 0; h < 2; h++) {
            const T * rp[kTile];
            const int nn = any[h] ? n[h] : 0;
            for (int c = 0; c < nn; c++) {
                rp[c] = krow(c0 + h * kTile + c);
            }
            for (int64_t d0 = 0; d0 < g.DK; d0 += 8) {
                __m256 t[8];
                load_tile<T>(rp, nn, d0, t);
                for (int j = 0; j < 8; j++) {
                    _mm256_storeu_ps(kt + (d0 + j) * 2 * kTile + h * kTile, t[j]);
                }
            }
        }
        // One FMA chain per cell over the dims in order: a score does not depend on the
        // tile, lane or rows it is computed with, so it is the same for any batch.
        __m256 s0[kRows], s1[kRows];
        for (int r = 0; r < kRows; r++) {
            s0[r] = s1[r] = _mm256_setzero_ps();
        }
        for (int64_t d = 0; d < g.DK; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * 2 * kTile), k1 = _mm256_loadu_ps(kt + d * 2 * kTile + kTile);
            for (int r = 0; r < nr; r++) {
                const __m256 qd = _mm256_set1_ps(qr[r][d]);
                s0[r] = _mm256_fmadd_ps(qd, k0, s0[r]);
                s1[r] = _mm256_fmadd_ps(qd, k1, s1[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            for (int h = 0; h < 2; h++) {
                __m256 x = _mm256_add_ps(_mm256_mul_ps(h == 0 ? s0[r] : s1[r], vscale), m[r][h]);
                x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(m[r][h], ninf, _CMP_EQ_OQ));
                _mm256_storeu_ps(sc + r * ldsc + c0 + h * kTile, x);
                mx[r] = _mm256_max_ps(mx[r], x); // lanes past the list hold -inf
            }
        }
    }

    // The maximum is exact whatever the order it is taken in.
    for (int r = 0; r < nr; r++) {
        float t[kTile];
        _mm256_storeu_ps(t, mx[r]);
        for (int c = 0; c < kTile; c++) {
            mrow[r] = t[c] > mrow[r] ? t[c] : mrow[r];
        }
    }

    // Pass 2: exp(s - max), then sum and weighted V rows in list (= position) order.
    float srow[kRows];
    for (int r = 0; r < nr; r++) {
        srow[r] = 0;
        memset(acc + r * g.DV, 0, g.DV * sizeof(float));
        if (mrow[r] == -INFINITY) {
            continue; // every cell masked: the output is zero, as the stock kernel's
        }
        // ggml's vectorized expf (internals.cpp: it lives in a private ggml-cpu header);
        // -1 marks a hidden cell.
        polykv_exp_row(sc + r * ldsc, nu, mrow[r]);
    }
    // Weighted V rows: each tile's V converted to f32 once for all rows; per row and
    // 64-dim chunk the accumulator lives in registers across the tile's cells, which are
    // added in list order.
    float * vt = kt; // [kTile][DV], reusing the K tile's space (kMaxD * 2 * kTile floats)
    for (int64_t c0 = 0; c0 < nu; c0 += kTile) {
        const int n = (int) (nu - c0 < kTile ? nu - c0 : kTile);
        bool any = false;
        for (int r = 0; r < nr && !any; r++) {
            for (int c = 0; c < n; c++) {
                any = any || sc[r * ldsc + c0 + c] >= 0.0f;
            }
        }
        if (!any) {
            continue;
        }
        for (int c = 0; c < kTile && c0 + 2 * kTile + c < nu; c++) {
            const char * vr = (const char *) vrow(c0 + 2 * kTile + c);
            for (int64_t o = 0; o < (int64_t) vrow_bytes; o += 64) {
                _mm_prefetch(vr + o, _MM_HINT_T0);
            }
        }
        for (int c = 0; c < n; c++) {
            const T * vr = vrow(c0 + c);
            for (int64_t d0 = 0; d0 < g.DV; d0 += 8) {
                _mm256_storeu_ps(vt + c * g.DV + d0, row8(vr, d0));
            }
        }
        for (int r = 0; r < nr; r++) {
            const float * p = sc + r * ldsc + c0;
            const bool full = n == kTile && _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_LT_OQ)) == 0;
            for (int64_t d0 = 0; d0 < g.DV; d0 += 64) {
                float * ar = acc + r * g.DV + d0;
                if (full && g.DV - d0 >= 64) {
                    accumulate<8, kTile>(ar, p, vt + d0, g.DV);
                } else {
                    accumulate_some(ar, p, n, vt + d0, g.DV, (int) ((g.DV - d0 < 64 ? g.DV - d0 : 64) / 8));
                }
            }
            float sum = srow[r];
            for (int c = 0; c < n; c++) {
                sum += p[c] >= 0.0f ? p[c] : 0.0f; // x + 0 == x: a hidden cell adds nothing
            }
            srow[r] = sum;
        }
    }

    for (int r = 0; r < nr; r++) {
        float S = srow[r];
        float * a = acc + r * g.DV;
        if (sinks) {
            const float s = ((const float *) sinks->data)[iq2[r]];
            const float M = mrow[r];
            if (s > M) {
                const float ms = M == -INFINITY ? 0.0f : expf(M - s);
                for (int64_t d = 0; d < g.DV; d++) {
                    a[d] *= ms;
                }
                S = S * ms + 1.0f;
            } else {
                S += expf(s - M);
            }
        }
        const float inv = S == 0.0f ? 0.0f : 1.0f / S;
        for (int64_t d = 0; d < g.DV; d++) {
            a[d] *= inv;
        }
        // permute(0, 2, 1, 3), as the stock kernel writes it.
        const int64_t ne1 = op->ne[1], ne2 = op->ne[2];
        memcpy((char *) op->data + (iq3[r] * ne2 * ne1 + iq2[r] + iq1[r] * ne1) * op->nb[1], a, op->nb[1]);
    }
}

// rows_per_block is how many query rows of one KV head a block takes (at most kRows).
// Which rows share a block does not change any row's arithmetic, only the work: a block
// converts its K/V tiles once (about four rows' cost) and computes its rows, so this
// picks the size with the shortest slowest thread. Prompt batches get kRows; a decode
// step of a model with one KV head (Gemma 3 270M: four query rows) gets two per block
// rather than one block for one thread while the others wait.
int rows_per_block(int64_t heads, int64_t per_head, int nth) {
    int best = kRows;
    int64_t best_cost = INT64_MAX;
    for (int r = kRows; r >= 1; r--) {
        const int64_t blocks = heads * ((per_head + r - 1) / r);
        const int64_t cost = (blocks + nth - 1) / nth * (4 + (r < per_head ? r : per_head));
        if (cost < best_cost) {
            best = r;
            best_cost = cost;
        }
    }
    return best;
}

// row_list is one mask row's visible cells (see traits::visible).
struct row_list {
    int64_t                 nkv = -1;
    const void *            cells = nullptr;
    std::vector<polykv_run> runs;
};

// Per compute thread: the mask rows' lists of the graph being computed (keyed by the
// row's address; dropped at every graph's first attention layer) and the scratch cell
// list of a block. Threads compute one graph at a time, so nothing is shared.
struct thread_cache {
    std::unordered_map<const void *, row_list>       rows;
    std::vector<uint32_t>                            idx;
};
thread_local thread_cache tl;

// traits is the kernel as ggml-cpu runs it (polykv_kernel: internals.cpp adapts it).
class traits {
  public:
    static bool work_size(int n_threads, const ggml_tensor * op, size_t * size) {
        *size = (size_t) n_threads * (scratch_floats(shape(op)) * sizeof(float) + 64);
        return true;
    }

    static bool compute(const polykv_compute * params, ggml_tensor * op) {
        const geometry g = shape(op);
        const size_t per = scratch_floats(g) * sizeof(float) + 64;
        // A new graph starts at its first attention layer: what this thread cached about the
        // previous graph's masks is stale from here (see visible()).
        bool first = false;
        const ggml_tensor * k = cache_view(op->src[1]), * v = cache_view(op->src[2]);
        const void * cells = polykv_cells_find(k->data, &first);
        if (cells != nullptr && v != op->src[2] && params->ith == 0) {
            polykv_cells_learn_v(k->data, v->data); // its cast may be skipped from now on
        }
        if (first || cells == nullptr) {
            tl.rows.clear();
        }
        if (params->wsize < per * params->nth) {
            return false; // planned without us (e.g. enabled mid-graph): stock kernel
        }
        if (cells != nullptr && params->ith == 0) {
            ordered.fetch_add(1, std::memory_order_relaxed);
        }
        float * wd = (float *) (((uintptr_t) ((char *) params->wdata + per * params->ith) + 63) & ~(uintptr_t) 63);
        // Rows sharing a KV head, grouped kRows at a time: for each (iq3, kv head), the
        // rows of its query heads, position by position. Blocks go round-robin to
        // threads (later rows of a causal prompt see more cells).
        if (params->ith == 0) {
            computed.fetch_add(1, std::memory_order_relaxed);
        }
        const ggml_tensor * mask = op->src[3];
        const int64_t nkvh = g.nq2 / g.rk2;
        const int64_t per_head = g.rk2 * g.N;
        const int rpb = rows_per_block(g.nq3 * nkvh, per_head, params->nth);
        const int64_t blocks_per_head = (per_head + rpb - 1) / rpb;
        const int64_t nblocks = g.nq3 * nkvh * blocks_per_head;
        for (int64_t b = params->ith; b < nblocks; b += params->nth) {
            const int64_t hb = b / blocks_per_head, ib = b % blocks_per_head;
            const int64_t iq3 = hb / nkvh, kh = hb % nkvh;
            int64_t rows[kRows];
            const std::vector<polykv_run> * lists[kRows];
            int64_t counts[kRows];
            int nr = 0;
            for (int64_t j = ib * rpb; j < per_head && nr < rpb; j++) {
                const int64_t iq1 = j / g.rk2, iq2 = kh * g.rk2 + j % g.rk2;
                rows[nr] = iq3 * g.nq2 * g.N + iq2 * g.N + iq1;
                const uint16_t * mrow = mask ? (const uint16_t *) ((const char *) mask->data + iq1 * mask->nb[1] +
                                                                  (iq2 % mask->ne[2]) * mask->nb[2] + (iq3 % mask->ne[3]) * mask->nb[3])
                                             : nullptr;
                lists[nr] = &visible(cells, mrow, g.nkv);
                counts[nr] = 0;
                for (const polykv_run & x : *lists[nr]) {
                    counts[nr] += x.len;
                }
                nr++;
            }
            // Rows whose visible cells are all among one lead row's (a prompt's rows of one
            // sequence, the query heads of one token) share its list and so its K/V tiles;
            // the others form groups of their own. Each row's cells are summed in position
            // order whichever group it is in.
            int pending[kRows];
            int np = nr;
            for (int r = 0; r < nr; r++) {
                pending[r] = r;
            }
            while (np > 0) {
                int lead = pending[0];
                for (int i = 1; i < np; i++) {
                    lead = counts[pending[i]] > counts[lead] ? pending[i] : lead;
                }
                int64_t grows[kRows];
                int ng = 0, keep = 0;
                for (int i = 0; i < np; i++) {
                    const int r = pending[i];
                    if (subset(*lists[r], *lists[lead])) {
                        grows[ng++] = rows[r];
                    } else {
                        pending[keep++] = r;
                    }
                }
                np = keep;
                std::vector<uint32_t> & idx = tl.idx;
                idx.clear();
                for (const polykv_run & x : *lists[lead]) {
                    for (uint32_t i = 0; i < x.len; i++) {
                        idx.push_back(x.cell + i);
                    }
                }
                switch (k->type) {
                case GGML_TYPE_F32: dispatch<float>(ng, op, g, grows, wd, idx.data(), (int64_t) idx.size()); break;
                case GGML_TYPE_Q8_0: dispatch<q8_block>(ng, op, g, grows, wd, idx.data(), (int64_t) idx.size()); break;
                case GGML_TYPE_Q4_0: dispatch<q4_block>(ng, op, g, grows, wd, idx.data(), (int64_t) idx.size()); break;
                default: dispatch<ggml_fp16_t>(ng, op, g, grows, wd, idx.data(), (int64_t) idx.size()); break;
                }
            }
        }
        return true;
    }

  private:
    template <typename T>
    static void dispatch(int nr, const ggml_tensor * op, const geometry & g, const int64_t * rows, float * wd, const uint32_t * idx, int64_t nu) {
        switch (nr) {
        case 1: block<1, T>(op, g, rows, wd, idx, nu); break;
        case 2: block<2, T>(op, g, rows, wd, idx, nu); break;
        case 3: block<3, T>(op, g, rows, wd, idx, nu); break;
        case 4: block<4, T>(op, g, rows, wd, idx, nu); break;
        case 5: block<5, T>(op, g, rows, wd, idx, nu); break;
        case 6: block<6, T>(op, g, rows, wd, idx, nu); break;
        case 7: block<7, T>(op, g, rows, wd, idx, nu); break;
        default: block<8, T>(op, g, rows, wd, idx, nu); break;
        }
    }

    // subset reports whether every cell of b (runs ordered by position) is a cell of a.
    static bool subset(const std::vector<polykv_run> & b, const std::vector<polykv_run> & a) {
        if (&a == &b) {
            return true;
        }
        size_t j = 0;
        for (const polykv_run & x : b) {
            while (j < a.size() && a[j].pos + (int64_t) a[j].len <= x.pos) {
                j++;
            }
            if (j == a.size()) {
                return false;
            }
            const polykv_run & y = a[j];
            if (y.pos > x.pos || x.pos + (int64_t) x.len > y.pos + (int64_t) y.len ||
                (int64_t) x.cell - x.pos != (int64_t) y.cell - y.pos) {
                return false;
            }
        }
        return true;
    }

    // visible is the list of a mask row's visible cells in position order, built once per
    // graph and thread: a mask row is the same for every layer and head of a graph, so
    // finding its cells (a scan of the row, 16 cells at a time where none is visible)
    // costs once per token and graph, not per layer. Without a registered cache (no
    // positions known, and no graph start to tell) it is rebuilt per node, in cell order.
    static const std::vector<polykv_run> & visible(const void * cells, const uint16_t * mrow, int64_t nkv) {
        row_list & e = tl.rows[mrow];
        if (e.nkv != nkv || e.cells != cells) {
            e.nkv = nkv;
            e.cells = cells;
            if (mrow == nullptr) {
                e.runs.assign(1, polykv_run{0, 0, (uint32_t) nkv});
            } else {
                polykv_visible_runs(cells, mrow, nkv, e.runs);
            }
        }
        return e.runs;
    }
};

// skip_cast leaves llama.cpp's f16 cast of an f32 cache view uncomputed: only PolyKV's
// kernel reads it, and that reads the f32 view under it (cache_view).
bool skip_cast_work_size(int, const ggml_tensor *, size_t * size) {
    *size = 0;
    return true;
}

bool skip_cast_compute(const polykv_compute * params, ggml_tensor *) {
    if (params->ith == 0) {
        skipped.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
}

const polykv_kernel fattn_kernel = {traits::work_size, traits::compute};
const polykv_kernel skip_cast_kernel = {skip_cast_work_size, skip_cast_compute};

}  // namespace

// polykv_kernel_for: one hook serves PolyKV's kernels: flash attention here, K-quant
// matrix products in kquant.cpp.
extern "C" const polykv_kernel * polykv_kernel_for(const ggml_tensor * op) {
    if (const polykv_kernel * kq = polykv_kq_kernel_for(op)) {
        return kq;
    }
    // The kernel is each context's choice (polykv_fattn_chosen): ggml-cpu asks about a
    // node, and the node's K view tells whose cache, so whose choice, it is.
    if (op->op == GGML_OP_CPY && op->type == GGML_TYPE_F16 && op->src[0]->type == GGML_TYPE_F32 &&
        polykv_cells_cast_skippable(op->src[0]->data)) {
        return &skip_cast_kernel;
    }
    if (op->op != GGML_OP_FLASH_ATTN_EXT || !polykv_fattn_chosen(cache_view(op->src[1])->data)) {
        return nullptr;
    }
    if (!supported(op)) {
        polykv_cells_mark_stock(cache_view(op->src[1])->data); // its context must compact again
        return nullptr;
    }
    return &fattn_kernel;
}

extern "C" int polykv_fattn_install(void) {
    const polykv_kernel * kernels[] = {&fattn_kernel, &skip_cast_kernel, polykv_kq_kernel(false), polykv_kq_kernel(true)};
    return polykv_hook_install(kernels, (int) (sizeof(kernels) / sizeof(kernels[0])));
}

extern "C" unsigned long long polykv_fattn_computed(void) { return computed.load(); }

extern "C" unsigned long long polykv_fattn_ordered(void) { return ordered.load(); }

extern "C" unsigned long long polykv_fattn_casts_skipped(void) { return skipped.load(); }

#else

extern "C" const polykv_kernel * polykv_kernel_for(const ggml_tensor *) { return nullptr; }

extern "C" int polykv_fattn_install(void) { return 0; }

extern "C" unsigned long long polykv_fattn_computed(void) { return 0; }

extern "C" unsigned long long polykv_fattn_ordered(void) { return 0; }

extern "C" unsigned long long polykv_fattn_casts_skipped(void) { return 0; }

#endif
