/* The block kinds' passes with fp32 activations (Q4_1, Q8_0), as macros that q4_1.c and q8_0.c
 * instantiate: QPASSES(kind id, name) then QGEMM(kind id, name) define dd_mm_<name>, with the
 * AVX-512 passes (WPASSES) where the build has them. */
#ifndef DD_QUANT_H
#define DD_QUANT_H
#include "common.h"

static inline __attribute__((always_inline)) void levels_at(int64_t kind, const uint8_t *blk, int64_t kk,
                                                            __m256 *q0, __m256 *q1) {
    if (kind == DD_Q4_1) { /* byte j: output j in the low nibble, output j + 8 in the high one */
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + kk * 8)));
        *q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
        *q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 32 + kk * 16));
        *q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        *q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    }
}

/* The end of a block for one row: t (+)= d * s (+ m * sx), two vectors of 8 outputs. */
static inline __attribute__((always_inline)) void block_end(int64_t kind, const uint8_t *blk, float sxv,
                                                            __m256 s0, __m256 s1, __m256 *t0, __m256 *t1) {
    *t0 = _mm256_fmadd_ps(half8(blk), s0, *t0);
    *t1 = _mm256_fmadd_ps(half8(blk + 16), s1, *t1);
    if (kind == DD_Q4_1) {
        const __m256 sx = _mm256_set1_ps(sxv);
        *t0 = _mm256_fmadd_ps(half8(blk + 32), sx, *t0);
        *t1 = _mm256_fmadd_ps(half8(blk + 48), sx, *t1);
    }
}

/* Quantised: rows [0, R) of x against group g, block by block (see levels_at). */
#define QPASS(KIND_ID, KIND, R)                                                                     \
    static void qpass_##KIND##_##R(const dd_weight *W, int64_t g, const float *x, int64_t ldx,      \
                                   const float *sx, float *y, int64_t ldy, int accumulate) {        \
        const int64_t nb = W->in / 32;                                                              \
        __m256 t0[R], t1[R];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) t0[r] = t1[r] = _mm256_setzero_ps();    \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            __m256 s0[R], s1[R];                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_ps(); \
            const uint8_t *blk = W->qs + (g * nb + b) * BLOCK_BYTES(KIND_ID);                       \
            PREFETCH_AHEAD(R, blk, BLOCK_BYTES(KIND_ID));                                           \
            for (int64_t kk = 0; kk < 32; kk++) {                                                   \
                __m256 q0, q1;                                                                      \
                levels_at(KIND_ID, blk, kk, &q0, &q1);                                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + b * 32 + kk);               \
                    s0[r] = _mm256_fmadd_ps(xv, q0, s0[r]);                                         \
                    s1[r] = _mm256_fmadd_ps(xv, q1, s1[r]);                                         \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
                block_end(KIND_ID, blk, KIND_ID == DD_Q4_1 ? sx[r * nb + b] : 0.0f, s0[r], s1[r], &t0[r], &t1[r]); \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
            store_group(W, g, t0[r], t1[r], y + r * ldy, accumulate);                               \
    }

/* Quantised, one row against groups g, g + 1, g + 2: six independent chains. */
#define QPASS1X3(KIND_ID, KIND)                                                                     \
    static void qpass_##KIND##_1x3(const dd_weight *W, int64_t g, const float *x, const float *sx, \
                                   float *y, int accumulate) {                                      \
        const int64_t nb = W->in / 32;                                                              \
        __m256 t[6];                                                                                \
        _Pragma("GCC unroll 8") for (int j = 0; j < 6; j++) t[j] = _mm256_setzero_ps();             \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            __m256 s[6];                                                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < 6; j++) s[j] = _mm256_setzero_ps();         \
            const uint8_t *blk = W->qs + (g * nb + b) * BLOCK_BYTES(KIND_ID);                       \
            const int64_t next = nb * BLOCK_BYTES(KIND_ID); /* the same block of the next group */  \
            for (int64_t kk = 0; kk < 32; kk++) {                                                   \
                const __m256 xv = _mm256_broadcast_ss(x + b * 32 + kk);                             \
                _Pragma("GCC unroll 4") for (int j = 0; j < 3; j++) {                               \
                    __m256 q0, q1;                                                                  \
                    levels_at(KIND_ID, blk + j * next, kk, &q0, &q1);                               \
                    s[2 * j] = _mm256_fmadd_ps(xv, q0, s[2 * j]);                                   \
                    s[2 * j + 1] = _mm256_fmadd_ps(xv, q1, s[2 * j + 1]);                           \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < 3; j++)                                     \
                block_end(KIND_ID, blk + j * next, KIND_ID == DD_Q4_1 ? sx[b] : 0.0f, s[2 * j], s[2 * j + 1], &t[2 * j], &t[2 * j + 1]); \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < 3; j++) store_group(W, g + j, t[2 * j], t[2 * j + 1], y, accumulate); \
    }

/* Quantised, rows [0, R) against groups g and g + 1 (4R chains: with 2 rows, one group alone
 * leaves the FMA units waiting on their own latency). The arithmetic of qpass. */
#define QPASSX2(KIND_ID, KIND, R)                                                                   \
    static void qpass_##KIND##_##R##x2(const dd_weight *W, int64_t g, const float *x, int64_t ldx,  \
                                       const float *sx, float *y, int64_t ldy, int accumulate) {    \
        const int64_t nb = W->in / 32, next = nb * BLOCK_BYTES(KIND_ID);                            \
        float tot[2 * R * 16] __attribute__((aligned(32)));                                         \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BLOCK_BYTES(KIND_ID);                       \
            __m256 s[4 * R];                                                                        \
            _Pragma("GCC unroll 16") for (int j = 0; j < 4 * R; j++) s[j] = _mm256_setzero_ps();    \
            for (int64_t kk = 0; kk < 32; kk++) {                                                   \
                __m256 q0, q1, v0, v1;                                                              \
                levels_at(KIND_ID, blk, kk, &q0, &q1);                                              \
                levels_at(KIND_ID, blk + next, kk, &v0, &v1);                                       \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + b * 32 + kk);               \
                    s[4 * r] = _mm256_fmadd_ps(xv, q0, s[4 * r]);                                   \
                    s[4 * r + 1] = _mm256_fmadd_ps(xv, q1, s[4 * r + 1]);                           \
                    s[4 * r + 2] = _mm256_fmadd_ps(xv, v0, s[4 * r + 2]);                           \
                    s[4 * r + 3] = _mm256_fmadd_ps(xv, v1, s[4 * r + 3]);                           \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const float sxv = KIND_ID == DD_Q4_1 ? sx[r * nb + b] : 0.0f;                        \
                for (int j = 0; j < 2; j++) {                                                       \
                    float *t = tot + (2 * r + j) * 16;                                              \
                    __m256 t0 = _mm256_load_ps(t), t1 = _mm256_load_ps(t + 8);                      \
                    block_end(KIND_ID, blk + j * next, sxv, s[4 * r + 2 * j], s[4 * r + 2 * j + 1], &t0, &t1); \
                    _mm256_store_ps(t, t0);                                                         \
                    _mm256_store_ps(t + 8, t1);                                                     \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < 2; j++)                                                             \
                store_group(W, g + j, _mm256_load_ps(tot + (2 * r + j) * 16), _mm256_load_ps(tot + (2 * r + j) * 16 + 8), \
                            y + r * ldy, accumulate);                                               \
    }

#define QPASSES(KIND_ID, KIND)                                                                      \
    QPASS(KIND_ID, KIND, 1) QPASS(KIND_ID, KIND, 2) QPASS(KIND_ID, KIND, 3) QPASS(KIND_ID, KIND, 4) \
    QPASS(KIND_ID, KIND, 5) QPASS(KIND_ID, KIND, 6) QPASS1X3(KIND_ID, KIND)                           \
    QPASSX2(KIND_ID, KIND, 2)                                                                       \
    /* all n rows against group g, in balanced tiles of at most TILE rows (7 = 4 + 3); the      \
     * group's levels stay in L1 between tiles */                                               \
    static void qgroup_##KIND(const dd_weight *W, int64_t g, const float *x, int64_t n,            \
                              const float *sx, float *y, int64_t ldy, int acc) {                    \
        const int64_t ldx = W->in, nb = W->in / 32, tiles = (n + TILE - 1) / TILE;                  \
        for (int64_t t = 0, r = 0; t < tiles; t++) {                                                \
            const int64_t rows = n / tiles + (t < n % tiles);                                       \
            const float *xr = x + r * ldx, *sr = sx + r * nb;                                       \
            float *yr = y + r * ldy;                                                                \
            switch (rows) {                                                                         \
            case 1: qpass_##KIND##_1(W, g, xr, ldx, sr, yr, ldy, acc); break;                       \
            case 2: qpass_##KIND##_2(W, g, xr, ldx, sr, yr, ldy, acc); break;                       \
            case 3: qpass_##KIND##_3(W, g, xr, ldx, sr, yr, ldy, acc); break;                       \
            case 4: qpass_##KIND##_4(W, g, xr, ldx, sr, yr, ldy, acc); break;                       \
            case 5: qpass_##KIND##_5(W, g, xr, ldx, sr, yr, ldy, acc); break;                       \
            default: qpass_##KIND##_6(W, g, xr, ldx, sr, yr, ldy, acc); break;                      \
            }                                                                                       \
            r += rows;                                                                              \
        }                                                                                           \
    }

#if DD_WIDE

static inline __attribute__((always_inline)) __m512 levels16(int64_t kind, const uint8_t *blk, int64_t kk) {
    if (kind == DD_Q4_1) { /* bytes 0-7: outputs 0-7 (low nibbles), then 8-15 (high nibbles) */
#if defined(__AVX512VBMI__)
        /* the 8 bytes in every 64-bit lane; each 32-bit lane o gets the 8 bits from its nibble's
         * first bit on (VPMULTISHIFTQB: output o < 8 at bit 8o, o >= 8 at 8(o - 8) + 4), and the
         * float of those bits' low 4 (VPERMPS reads only the low 4 bits of an index): the levels as
         * floats in two operations instead of a widening and a conversion */
        long long bytes8;
        memcpy(&bytes8, blk + 64 + kk * 8, 8);
        const __m512i v = _mm512_set1_epi64(bytes8);
        const __m512i idx = _mm512_multishift_epi64_epi8(
            _mm512_setr_epi64(0x0000000800000000LL, 0x0000001800000010LL, 0x0000002800000020LL, 0x0000003800000030LL,
                              0x0000000C00000004LL, 0x0000001C00000014LL, 0x0000002C00000024LL, 0x0000003C00000034LL), v);
        return _mm512_permutexvar_ps(idx, _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f,
                                                         10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f));
#elif defined(__GFNI__)
        /* the 8 bytes in both halves, one affine byte map: low nibbles, then high ones (see a8_levels16) */
        const __m128i v = _mm_castpd_si128(_mm_loaddup_pd((const double *)(blk + 64 + kk * 8)));
        const __m128i q = _mm_gf2p8affine_epi64_epi8(v, _mm_set_epi64x(NIBBLE_HIGH, NIBBLE_LOW), 0);
#else
        const __m128i v = _mm_loadl_epi64((const __m128i *)(blk + 64 + kk * 8));
        const __m128i q = _mm_and_si128(_mm_unpacklo_epi64(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(0x0F));
#endif
#if !defined(__AVX512VBMI__)
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
#endif
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + kk * 16))));
}

typedef void (*wide_pass)(const dd_weight *W, int64_t g, const float *x, int64_t ldx, const float *sx,
                          float *y, int64_t ldy, int accumulate);

/* Rows [0, R) against groups [g, g + G): per block, R * G running sums in registers, the scaled
 * totals in memory (t (+)= d * s (+ m * sx): block_end's FMAs, lane by lane). */
#define WPASS(KIND_ID, KIND, R, G)                                                                  \
    static void wpass_##KIND##_##R##_##G(const dd_weight *W, int64_t g, const float *x, int64_t ldx, \
                                         const float *sx, float *y, int64_t ldy, int accumulate) {  \
        const int64_t nb = W->in / 32, next = nb * BLOCK_BYTES(KIND_ID);                            \
        float tot[R * G * 16] __attribute__((aligned(64)));                                         \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BLOCK_BYTES(KIND_ID);                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) PREFETCH_AHEAD(R, blk + j * next, BLOCK_BYTES(KIND_ID)); \
            __m512 s[R * G];                                                                        \
            _Pragma("GCC unroll 16") for (int j = 0; j < R * G; j++) s[j] = _mm512_setzero_ps();    \
            for (int64_t kk = 0; kk < 32; kk++) {                                                   \
                __m512 q[G];                                                                        \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) q[j] = levels16(KIND_ID, blk + j * next, kk); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m512 xv = _mm512_set1_ps(x[r * ldx + b * 32 + kk]);                      \
                    _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                             \
                        s[r * G + j] = _mm512_fmadd_ps(xv, q[j], s[r * G + j]);                      \
                }                                                                                   \
            }                                                                                       \
            __m512 dv[G], mv[G];                                                                    \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                                   \
                dv[j] = half16(blk + j * next);                                                     \
                mv[j] = KIND_ID == DD_Q4_1 ? half16(blk + j * next + 32) : dv[j];                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                               \
                    float *t = tot + (r * G + j) * 16;                                              \
                    __m512 tv = _mm512_fmadd_ps(dv[j], s[r * G + j], _mm512_load_ps(t));            \
                    if (KIND_ID == DD_Q4_1) tv = _mm512_fmadd_ps(mv[j], _mm512_set1_ps(sx[r * nb + b]), tv); \
                    _mm512_store_ps(t, tv);                                                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < G; j++) store_outputs(W, g + j, tot + (r * G + j) * 16, y + r * ldy, accumulate); \
    }

#define WPASSES(KIND_ID, KIND)                                                                      \
    WPASS(KIND_ID, KIND, 1, 1) WPASS(KIND_ID, KIND, 2, 1) WPASS(KIND_ID, KIND, 3, 1) WPASS(KIND_ID, KIND, 4, 1) \
    WPASS(KIND_ID, KIND, 5, 1) WPASS(KIND_ID, KIND, 6, 1) WPASS(KIND_ID, KIND, 7, 1) WPASS(KIND_ID, KIND, 8, 1) \
    WPASS(KIND_ID, KIND, 1, 2) WPASS(KIND_ID, KIND, 2, 2) WPASS(KIND_ID, KIND, 3, 2) WPASS(KIND_ID, KIND, 4, 2) \
    WPASS(KIND_ID, KIND, 5, 2) WPASS(KIND_ID, KIND, 6, 2) WPASS(KIND_ID, KIND, 7, 2) WPASS(KIND_ID, KIND, 8, 2) \
    WPASS(KIND_ID, KIND, 1, 3) WPASS(KIND_ID, KIND, 2, 3) WPASS(KIND_ID, KIND, 3, 3) WPASS(KIND_ID, KIND, 4, 3) \
    WPASS(KIND_ID, KIND, 1, 4) WPASS(KIND_ID, KIND, 2, 4)                                           \
    static const wide_pass wide_##KIND[4][WIDE_TILE] = {                                            \
        {wpass_##KIND##_1_1, wpass_##KIND##_2_1, wpass_##KIND##_3_1, wpass_##KIND##_4_1,            \
         wpass_##KIND##_5_1, wpass_##KIND##_6_1, wpass_##KIND##_7_1, wpass_##KIND##_8_1},           \
        {wpass_##KIND##_1_2, wpass_##KIND##_2_2, wpass_##KIND##_3_2, wpass_##KIND##_4_2,            \
         wpass_##KIND##_5_2, wpass_##KIND##_6_2, wpass_##KIND##_7_2, wpass_##KIND##_8_2},           \
        {wpass_##KIND##_1_3, wpass_##KIND##_2_3, wpass_##KIND##_3_3, wpass_##KIND##_4_3},           \
        {wpass_##KIND##_1_4, wpass_##KIND##_2_4}};                                                  \
    /* all n rows; each thread's groups (thread_groups) G at a time (G from dd_wide_groups for \
     * the largest tile), each unit of G groups against balanced tiles of at most WIDE_TILE     \
     * rows (a short last unit takes a pass of fewer groups) */                                 \
    static void wide_gemm_##KIND(const dd_weight *W, const float *x, int64_t n, const float *sx,   \
                                 float *y, int64_t ldy, int acc) {                                  \
        const int64_t groups = (W->out + 15) / 16, nb = W->in / 32, ldx = W->in;                    \
        const int64_t tiles = (n + WIDE_TILE - 1) / WIDE_TILE;                                      \
        const int64_t G = wide_groups(KIND_ID, n);                                                  \
        span_start(groups);                                                                         \
        int64_t g = -1, ng;                                                                         \
        while ((ng = span_next(groups, G, &g)) > 0) {                                               \
            for (int64_t t = 0, r = 0; t < tiles; t++) {                                            \
                const int64_t rows = n / tiles + (t < n % tiles);                                   \
                wide_##KIND[ng - 1][rows - 1](W, g, x + r * ldx, ldx, sx + r * nb, y + r * ldy, ldy, acc); \
                r += rows;                                                                          \
            }                                                                                       \
        }                                                                                           \
    dd_sync();                                                                                      \
    }
#define WIDE_CALL(KIND_ID, KIND)                                                                      \
    if (wide_groups(KIND_ID, n)) {                                                                  \
        wide_gemm_##KIND(W, x, n, sx, y, ldy, acc);                                                 \
        free(sx);                                                                                   \
        return;                                                                                     \
    }
#else
#define WPASSES(KIND_ID, KIND)
#define WIDE_CALL(KIND_ID, KIND)
#endif

/* Quantised y (+)= x @ W^T inside a parallel region (see dd_matmul), one function per kind. */
#define QGEMM(KIND_ID, KIND)                                                                        \
WPASSES(KIND_ID, KIND)                                                                              \
DD_HIDDEN void dd_mm_##KIND(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) { \
    const int64_t groups = (W->out + 15) / 16, nb = W->in / 32;                                     \
    const int q4 = KIND_ID == DD_Q4_1;                                                              \
    float *sx = malloc(sizeof(float) * (size_t)(n * nb + 1)); /* each thread its own copy: no sharing */ \
    if (q4) block_sums(x, n, W->in, sx);                                                            \
    WIDE_CALL(KIND_ID, KIND)                                                                               \
    if (n == 1) { /* three groups per pass: six FMA chains hide the FMA latency */                  \
        const int64_t triples = (groups + 2) / 3;                                                   \
        span_start(triples);                                                                        \
        for (int64_t t = -1; span_next(triples, 1, &t) > 0;) {                                      \
            const int64_t g = 3 * t;                                                                \
            if (g + 3 <= groups) {                                                                  \
                qpass_##KIND##_1x3(W, g, x, sx, y, acc);                                            \
            } else {                                                                                \
                for (int64_t j = g; j < groups; j++) {                                              \
                    qpass_##KIND##_1(W, j, x, W->in, sx, y, ldy, acc);                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    } else if (n == 2) { /* two groups per pass (measured: with 3 rows, one group per pass is faster) */ \
        const int64_t pairs = (groups + 1) / 2;                                                     \
        span_start(pairs);                                                                          \
        for (int64_t p = -1; span_next(pairs, 1, &p) > 0;) {                                        \
            const int64_t g = 2 * p;                                                                \
            if (g + 2 > groups) {                                                                   \
                qgroup_##KIND(W, g, x, n, sx, y, ldy, acc);                                         \
            } else {                                                                                \
                qpass_##KIND##_2x2(W, g, x, W->in, sx, y, ldy, acc);                                \
            }                                                                                       \
        }                                                                                           \
    } else {                                                                                        \
        span_start(groups);                                                                         \
        for (int64_t g = -1; span_next(groups, 1, &g) > 0;) {                                       \
            qgroup_##KIND(W, g, x, n, sx, y, ldy, acc);                                             \
        }                                                                                           \
    }                                                                                               \
    dd_sync();                                                                                      \
    free(sx);                                                                                       \
}

#endif /* DD_QUANT_H */
