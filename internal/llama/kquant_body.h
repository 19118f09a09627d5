// The body of PolyKV's matrix kernel (kquant.cpp includes it twice: once for AVX2 and
// once under a VNNI target, chosen at run time). Not a standalone header.
// NOLINTBEGIN
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
#if POLYKV_KQ_VNNI
    return _mm256_dpbusd_epi32(acc, w, a);
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
// all N activation rows, with scratch for the packed blocks, holding at most budget bytes
// of them at once (group_blocks).
template <class T>
void rows(const char * w, size_t wstride, int64_t r0, int64_t r1, int64_t K, const char * act, size_t astride, int64_t N,
          char * dst, size_t dstride, void * scratch, size_t budget) {
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
    const int64_t group = group_blocks(nsb, sizeof(packed<T>), budget);
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
// NOLINTEND
