/* The K block kinds (GGUF's Q4_K, Q5_K, Q6_K and Q3_K weights), and Q5_1 (whose 5-bit levels take
 * the same passes), with fp32 activations and with 8-bit ones, as macros that q4_k.c, q6_k.c and
 * q5_1.c instantiate.
 *
 * A K-type tensor is made of super-blocks of 256 inputs: per super-block an fp16 scale d (and, for
 * Q4_K / Q5_K, an fp16 dmin), and per sub-block of 32 (Q4_K, Q5_K) or 16 inputs (Q6_K, Q3_K) a small
 * integer scale sc (and minimum m). gguf-py dequantises w = fl(d * sc) * q - fl(dmin * m); both
 * products are exact in fp32 (an fp16 times an integer of at most 8 bits), so the kernels keep the
 * integers and rebuild the products where they use them: the same values as the file's fp32
 * weights, a fraction of the bytes.
 *
 * Layout (one group of 16 outputs, as every block kind): the super-block scales in a side array
 * W->d [G, in / 256, 32] floats (16 d, then 16 dmin: 0 where the type has none), and per block of
 * 32 inputs a header of small integers then the levels:
 *   DD_Q4_K: 288 bytes: 16 sc (int8), 16 m (uint8), then the 4-bit levels as DD_Q4_1's (byte
 *            8k + j = q(output j, k) | q(output j + 8, k) << 4);
 *   DD_Q6_K: 576 bytes: 16 sc of inputs 0-15, 16 sc of inputs 16-31 (int8), 16 m, 16 zero points z
 *            (uint8, used by DD_Q6_K_A8), then the levels q as int8 (byte 16k + o = q(o, k)): Q6_K's
 *            q - 32 (z 32), Q3_K's signed 3-bit levels (z 4), Q5_K's 0..31 or Q4_K's 0..15 where a
 *            Q4_K weight is stacked with one of those (q|k|v with a Q6_K v; z 0): every K type fits
 *            it exactly;
 *   DD_Q5_1: 576 bytes: 16 d, 16 -m (fp16, as the file's d and m: exact), then the levels 0..31
 *            as DD_Q6_K's (w = d * q + m: one scale per 32 inputs, no side array);
 *   DD_Q4_K_A8: DD_Q4_K's header, the levels per quad of 4 inputs as DD_Q4_1_A8's;
 *   DD_Q6_K_A8, DD_Q5_1_A8: 448 bytes: the same headers, then 6-bit levels u = q + z (7 bits a
 *            weight where DD_Q6_K takes 9; the file's Q6_K 6.56): per quad of 4 inputs their low
 *            nibbles in DD_Q4_1_A8's order and their high 2 bits (see k_levels_a8). With fp32
 *            activations the bytes are cheaper to turn into floats, with 8-bit ones the bits are.
 *
 * Per block and output the kernel sums x * q over each sub-block with one scale (32 inputs, or
 * 16 twice), from zero in order of k, then t = fma(fl(d * sc), s, t) per sub-block and
 * t = t - fl(dmin * m) * sx (sx: the block's sum of x, as DD_Q4_1's minimum term). As for the other
 * kinds, an output's arithmetic depends neither on the other rows, nor on the outputs sharing a
 * pass, nor on the threads. With 8-bit activations (per block of 32: x ~ dx * qx, qx in [-127, 127])
 * the sums over sub-blocks are exact integers and the scale is fl(fl(d * sc) * dx). */
#ifndef DD_KQUANT_H
#define DD_KQUANT_H
#include "common.h"
#include "a8.h"

#define K_NIBBLES(K) ((K) == DD_Q4_K || (K) == DD_Q4_K_A8)
#define K_FP16(K) ((K) == DD_Q5_1 || (K) == DD_Q5_1_A8) /* fp16 scales per block, no super-block */
#define K_A8(K) ((K) == DD_Q4_K_A8 || (K) == DD_Q6_K_A8 || (K) == DD_Q5_1_A8)
#define K_BYTES(K) (K_NIBBLES(K) ? 288 : K_A8(K) ? 448 : 576)
#define K_ZERO(K) ((K) == DD_Q6_K_A8) /* 6-bit levels stored as q + z, z per output */
#define K_MINS(K) (K_NIBBLES(K) ? 16 : 32)          /* where the 16 minimums are */
#define K_HALVES(K) (!K_NIBBLES(K) && !K_FP16(K))   /* a scale per 16 inputs */

/* group g's super-block scales for block b: 16 d, then 16 dmin (NULL for DD_Q5_1: none) */
static inline __attribute__((always_inline)) const float *k_super(const dd_weight *W, int64_t g, int64_t b) {
    return W->d ? W->d + (g * (W->in / 256) + (b >> 3)) * 32 : NULL;
}

/* fl(d * sc) for 8 outputs: p the 8 int8 scales, d their super-block scales (exact: see above) */
static inline __attribute__((always_inline)) __m256 k_scale8(const uint8_t *p, const float *d) {
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_loadu_ps(d));
}

/* fl(dmin * m) for 8 outputs (m unsigned) */
static inline __attribute__((always_inline)) __m256 k_min8(const uint8_t *p, const float *dmin) {
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_loadu_ps(dmin));
}

/* the levels of input k for outputs 0-7 (q0) and 8-15 (q1), as floats: 4-bit ones (q4_k) or signed
 * bytes (the 8-bit layouts with fp32 activations) */
static inline __attribute__((always_inline)) void k_levels(int64_t kind, const uint8_t *blk, int64_t k, __m256 *q0,
                                                           __m256 *q1) {
    if (K_NIBBLES(kind)) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 32 + k * 8)));
        *q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
        *q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 64 + k * 16));
        *q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        *q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    }
}

/* the scales of sub-block h, outputs 8o .. 8o + 7 */
static inline __attribute__((always_inline)) __m256 k_scale(int64_t kind, const uint8_t *blk, const float *sup, int h, int o) {
    if (K_FP16(kind)) return half8(blk + 16 * o);
    return k_scale8(blk + (K_HALVES(kind) ? 16 * h : 0) + 8 * o, sup + 8 * o);
}

/* the minimums (as subtracted), outputs 8o .. 8o + 7: DD_Q5_1 keeps -m in fp16 (exact) */
static inline __attribute__((always_inline)) __m256 k_min(int64_t kind, const uint8_t *blk, const float *sup, int o) {
    if (K_FP16(kind)) return half8(blk + 32 + 16 * o);
    return k_min8(blk + K_MINS(kind) + 8 * o, sup + 16 + 8 * o);
}

/* t[0..16) (in memory) = fma(scale, s, t) for sub-block h's scales of block blk */
static inline __attribute__((always_inline)) void k_scaled(int64_t kind, const uint8_t *blk, const float *sup, int h,
                                                           __m256 s0, __m256 s1, float *t) {
    _mm256_store_ps(t, _mm256_fmadd_ps(k_scale(kind, blk, sup, h, 0), s0, _mm256_load_ps(t)));
    _mm256_store_ps(t + 8, _mm256_fmadd_ps(k_scale(kind, blk, sup, h, 1), s1, _mm256_load_ps(t + 8)));
}

/* t[0..16) = t - fl(dmin * m) * sx: the block's minimums */
static inline __attribute__((always_inline)) void k_minimum(int64_t kind, const uint8_t *blk, const float *sup,
                                                            float sxv, float *t) {
    const __m256 sx = _mm256_set1_ps(sxv);
    _mm256_store_ps(t, _mm256_fnmadd_ps(k_min(kind, blk, sup, 0), sx, _mm256_load_ps(t)));
    _mm256_store_ps(t + 8, _mm256_fnmadd_ps(k_min(kind, blk, sup, 1), sx, _mm256_load_ps(t + 8)));
}

/* fp32 activations: rows [0, R) of x against groups [g, g + G), per sub-block 2 R G running sums in
 * registers (R G <= 6: 12 sums, 2 G level registers and a broadcast), the scaled totals in memory */
#define KPASS(KIND_ID, KIND, R, G)                                                                  \
    static void kpass_##KIND##_##R##_##G(const dd_weight *W, int64_t g, const float *x, int64_t ldx, \
                                         const float *sx, float *y, int64_t ldy, int accumulate) {  \
        enum { BYTES = K_BYTES(KIND_ID), SUBS = K_HALVES(KIND_ID) ? 2 : 1 };                        \
        const int64_t nb = W->in / 32, next = nb * BYTES, snext = W->in / 256 * 32;                  \
        float tot[R * G * 16] __attribute__((aligned(32)));                                         \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BYTES;                                      \
            const float *sup = k_super(W, g, b);                                                    \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) PREFETCH_AHEAD(R, blk + j * next, BYTES); \
            _Pragma("GCC unroll 2") for (int h = 0; h < SUBS; h++) {                                \
                __m256 s[2 * R * G];                                                                \
                _Pragma("GCC unroll 16") for (int j = 0; j < 2 * R * G; j++) s[j] = _mm256_setzero_ps(); \
                for (int64_t k = h * (32 / SUBS); k < (h + 1) * (32 / SUBS); k++) {                 \
                    __m256 q[2 * G];                                                                \
                    _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                             \
                        k_levels(KIND_ID, blk + j * next, k, &q[2 * j], &q[2 * j + 1]);             \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                           \
                        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + b * 32 + k);            \
                        _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                       \
                            s[2 * (r * G + j)] = _mm256_fmadd_ps(xv, q[2 * j], s[2 * (r * G + j)]); \
                            s[2 * (r * G + j) + 1] = _mm256_fmadd_ps(xv, q[2 * j + 1], s[2 * (r * G + j) + 1]); \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                    _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                             \
                        k_scaled(KIND_ID, blk + j * next, sup + j * snext, h, s[2 * (r * G + j)],   \
                                 s[2 * (r * G + j) + 1], tot + (r * G + j) * 16);                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                                 \
                    k_minimum(KIND_ID, blk + j * next, sup + j * snext, sx[r * nb + b], tot + (r * G + j) * 16); \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < G; j++) store_outputs(W, g + j, tot + (r * G + j) * 16, y + r * ldy, accumulate); \
    }

/* y (+)= x @ W^T with fp32 activations inside a parallel region (see dd_matmul): one row three
 * groups at a time (six FMA chains), two rows two groups at a time, more rows group by group in
 * balanced tiles of at most 6 rows (the group's levels stay in L1 between tiles) */
#define KGEMM(KIND_ID, KIND)                                                                        \
    KPASS(KIND_ID, KIND, 1, 1) KPASS(KIND_ID, KIND, 1, 3) KPASS(KIND_ID, KIND, 2, 2)                \
    KPASS(KIND_ID, KIND, 2, 1) KPASS(KIND_ID, KIND, 3, 1) KPASS(KIND_ID, KIND, 4, 1)                \
    KPASS(KIND_ID, KIND, 5, 1) KPASS(KIND_ID, KIND, 6, 1)                                           \
    DD_HIDDEN void dd_mm_##KIND(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) { \
        static void (*const tile[6])(const dd_weight *, int64_t, const float *, int64_t, const float *, float *, \
                                     int64_t, int) = {kpass_##KIND##_1_1, kpass_##KIND##_2_1, kpass_##KIND##_3_1, \
                                                      kpass_##KIND##_4_1, kpass_##KIND##_5_1, kpass_##KIND##_6_1}; \
        const int64_t groups = (W->out + 15) / 16, nb = W->in / 32, ldx = W->in;                     \
        float *sx = malloc(sizeof(float) * (size_t)(n * nb + 1)); /* each thread its own copy */    \
        block_sums(x, n, W->in, sx);                                                                \
        const int64_t per = n == 1 ? 3 : n == 2 ? 2 : 1, units = (groups + per - 1) / per;           \
        span_start(units);                                                                          \
        for (int64_t u = -1; span_next(units, 1, &u) > 0;) {                                        \
            const int64_t g = u * per;                                                              \
            if (n == 1 && g + 3 <= groups) {                                                        \
                kpass_##KIND##_1_3(W, g, x, ldx, sx, y, ldy, acc);                                  \
            } else if (n == 2 && g + 2 <= groups) {                                                 \
                kpass_##KIND##_2_2(W, g, x, ldx, sx, y, ldy, acc);                                  \
            } else {                                                                                \
                const int64_t tiles = (n + 5) / 6;                                                  \
                for (int64_t j = g; j < g + per && j < groups; j++)                                 \
                    for (int64_t t = 0, r = 0; t < tiles; t++) {                                    \
                        const int64_t rows = n / tiles + (t < n % tiles);                           \
                        tile[rows - 1](W, j, x + r * ldx, ldx, sx + r * nb, y + r * ldy, ldy, acc); \
                        r += rows;                                                                  \
                    }                                                                               \
            }                                                                                       \
        }                                                                                           \
        dd_sync();                                                                                  \
        free(sx);                                                                                   \
    }

/* 8-bit activations: the zero points of outputs 0-7 (zv[0]) and 8-15 (zv[1]) as shift counts, 32-bit
 * lanes: z is 32, 4 or 0 (see the layout), z * S = S << log2(z), and a count of 32 or more (z = 0:
 * the float 0's exponent field less 127, as unsigned) shifts every bit out; no multiplication. */
static inline __attribute__((always_inline)) __m256i k_zero_shift(const uint8_t *z) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)z)));
    return _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(f), 23), _mm256_set1_epi32(127));
}

static inline __attribute__((always_inline)) void k_zeros_a8(int64_t kind, const uint8_t *blk, __m256i *zv) {
    if (K_ZERO(kind)) {
        zv[0] = k_zero_shift(blk + 48);
        zv[1] = k_zero_shift(blk + 56);
    } else {
        zv[0] = zv[1] = _mm256_setzero_si256();
    }
}

/* 8-bit activations, 6-bit levels of quad i (inputs 4i .. 4i + 3) as unsigned bytes u = q + z
 * (0..63): w0 byte 4o + j = level of output o, w1 of output o + 8. Stored per quad as the low
 * nibbles in DD_Q4_1_A8's order (32 bytes), then 16 bytes of high 2-bit pairs: bits 2s, 2s + 1 of
 * byte b belong to level b + 16 s of the 64 (w0's 32 bytes, then w1's). */
static inline __attribute__((always_inline)) void k_levels_a8(const uint8_t *blk, int i, __m256i *w0, __m256i *w1) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i L = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * i));
    const __m256i H = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 320 + 16 * i)));
    const __m256i h0 = _mm256_and_si256(_mm256_sllv_epi64(H, _mm256_setr_epi64x(4, 4, 2, 2)), top);
    const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi64(H, _mm256_setr_epi64x(0, 0, 2, 2)), top);
    *w0 = _mm256_or_si256(_mm256_and_si256(L, low), h0);
    *w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), low), h1);
}

/* s + the products of two quads' unsigned levels (ua, ub: 0..63) and one row's rounded activations
 * (xa, xb), in 32-bit lanes: without VNNI the two quads' pair sums are added in 16 bits before
 * widening (4 products of at most 63 * 127 each: |sum| <= 32004 < 2^15, never saturating). */
static inline __attribute__((always_inline)) __m256i k_acc_pair(__m256i s, __m256i ua, __m256i xa, __m256i ub,
                                                                __m256i xb) {
#if DD_VNNI
    return DD_DPBUSD(DD_DPBUSD(s, ua, xa), ub, xb);
#else
    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(ua, xa), _mm256_maddubs_epi16(ub, xb));
    return _mm256_add_epi32(s, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
#endif
}

/* 8-bit activations: t[0..16) += fl(fl(d * sc) * dx) * s for sub-block h (s: integer sums) */
static inline __attribute__((always_inline)) void k_scaled_a8(int64_t kind, const uint8_t *blk, const float *sup, int h,
                                                              float dxv, __m256i s0, __m256i s1, float *t) {
    const __m256 dx = _mm256_set1_ps(dxv);
    _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(k_scale(kind, blk, sup, h, 0), dx),
                                       _mm256_load_ps(t)));
    _mm256_store_ps(t + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(k_scale(kind, blk, sup, h, 1), dx),
                                           _mm256_load_ps(t + 8)));
}

/* 8-bit activations, rows [0, R) against group g: per sub-block 2R integer sums in registers. The
 * 4-bit levels' in 16-bit lanes without VNNI (at most 8 * 2 * 15 * 127 < 2^15, as DD_Q4_1_A8's);
 * the 6-bit ones as unsigned bytes u = q + z, two quads at a time (k_acc_pair), less z times the
 * row's sum of qx over the sub-block (sq: the rows' sums per 16 inputs), which is the same integer
 * as the sum of (u - z) * qx: multiplying the unsigned levels needs no sign moved onto each
 * activation, and two quads share a widening (six instructions per row and quad without VNNI,
 * against nine) */
#define KAPASS(KIND_ID, KIND, R)                                                                    \
    static void kapass_##KIND##_##R(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, \
                                    const float *sx, const int32_t *sq, float *y, int64_t ldy, int accumulate) { \
        enum { BYTES = K_BYTES(KIND_ID), SUBS = K_HALVES(KIND_ID) ? 2 : 1, QUADS = 8 / SUBS };      \
        const int64_t nb = W->in / 32, in = W->in;                                                  \
        float tot[R * 16] __attribute__((aligned(32)));                                             \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BYTES;                                      \
            const float *sup = k_super(W, g, b);                                                    \
            for (int l = 0; l < BYTES; l += 64) _mm_prefetch((const char *)blk + A8_AHEAD * BYTES + l, _MM_HINT_T0); \
            PREFETCH_AHEAD(R, blk, BYTES);                                                          \
            __m256i zv[2];                                                                          \
            k_zeros_a8(KIND_ID, blk, zv);                                                           \
            _Pragma("GCC unroll 2") for (int h = 0; h < SUBS; h++) {                                \
                __m256i s0[R], s1[R];                                                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256(); \
                if (K_NIBBLES(KIND_ID)) {                                                           \
                    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                           \
                        const __m256i L = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * i)); \
                        A8_NIBBLE_QUAD(R, L, qx + b * 32 + 4 * i, in, s0, s1);                      \
                    }                                                                               \
                } else {                                                                            \
                    _Pragma("GCC unroll 4") for (int i = h * QUADS; i < (h + 1) * QUADS; i += 2) {  \
                        __m256i ua0, ua1, ub0, ub1;                                                 \
                        k_levels_a8(blk, i, &ua0, &ua1);                                            \
                        k_levels_a8(blk, i + 1, &ub0, &ub1);                                        \
                        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                       \
                            const int8_t *xq = qx + r * in + b * 32 + 4 * i;                        \
                            const __m256i xa = bcast4(xq), xb = bcast4(xq + 4);                     \
                            s0[r] = k_acc_pair(s0[r], ua0, xa, ub0, xb);                            \
                            s1[r] = k_acc_pair(s1[r], ua1, xa, ub1, xb);                            \
                            __asm__("" : "+x"(s0[r]), "+x"(s1[r]));                                 \
                        }                                                                           \
                    }                                                                               \
                    if (K_ZERO(KIND_ID))                                                            \
                        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                       \
                            const __m256i S = _mm256_set1_epi32(sq[r * 2 * nb + 2 * b + h]);        \
                            s0[r] = _mm256_sub_epi32(s0[r], _mm256_sllv_epi32(S, zv[0]));           \
                            s1[r] = _mm256_sub_epi32(s1[r], _mm256_sllv_epi32(S, zv[1]));           \
                        }                                                                           \
                }                                                                                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256i w0 = K_NIBBLES(KIND_ID) ? a8_widen(s0[r]) : s0[r];                \
                    const __m256i w1 = K_NIBBLES(KIND_ID) ? a8_widen(s1[r]) : s1[r];                \
                    k_scaled_a8(KIND_ID, blk, sup, h, dx[r * nb + b], w0, w1, tot + r * 16);        \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) k_minimum(KIND_ID, blk, sup, sx[r * nb + b], tot + r * 16); \
        }                                                                                           \
        for (int r = 0; r < R; r++) store_outputs(W, g, tot + r * 16, y + r * ldy, accumulate);     \
    }

/* y (+)= x @ W^T with 8-bit activations (a8_gemm: the rounding of the rows, shared or not, and
 * their block sums for the minimums): tiles of at most A8_TILE_NIBBLES rows for 4-bit levels, whose
 * 2R sums, two level registers and a broadcast row fit the 16 vector registers, and of at most 4
 * for 6-bit ones (four level registers and two broadcasts) */
#define KAGEMM(KIND_ID, KIND)                                                                       \
    KAPASS(KIND_ID, KIND, 1) KAPASS(KIND_ID, KIND, 2) KAPASS(KIND_ID, KIND, 3) KAPASS(KIND_ID, KIND, 4) \
    KAPASS(KIND_ID, KIND, 5) KAPASS(KIND_ID, KIND, 6)                                               \
    DD_HIDDEN void dd_mm_##KIND(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) { \
        static const a8_pass passes[6] = {kapass_##KIND##_1, kapass_##KIND##_2, kapass_##KIND##_3, \
                                          kapass_##KIND##_4, kapass_##KIND##_5, kapass_##KIND##_6}; \
        a8_gemm(W, x, n, y, ldy, acc, passes, K_NIBBLES(KIND_ID) ? A8_TILE_NIBBLES : 4, NULL);      \
    }

#endif /* DD_KQUANT_H */
