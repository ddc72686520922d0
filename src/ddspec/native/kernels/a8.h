/* What the 8-bit-activation kinds (DD_Q4_1_A8 in q4_1.c, DD_Q8_0_A8 in q8_0.c, the K kinds of kquant.h) share: the integer
 * steps, the rounding of the rows, a8_gemm (the loop over groups and tiles that calls a kind's
 * passes) and the AVX-512 VNNI passes as a macro (AWPASSES). Static: each kind's file has its own
 * copy, in the same unit as the passes it calls. */
#ifndef DD_A8_H
#define DD_A8_H
#include "common.h"

/* VNNI, where the build enables it (native/build.py adds -mavxvnni, or -mavx512vnni -mavx512vl,
 * on CPUs that have them): vpdpbusd adds four products of an unsigned and a signed byte into each
 * 32-bit lane, exactly the integers that vpmaddubsw (pairs to 16 bits, which cannot saturate
 * here) and the widening vpmaddwd give, in one instruction instead of two or three. The sums,
 * hence the results, are the same bits either way. */
#if defined(__AVXVNNI__)
#define DD_VNNI 1
#define DD_DPBUSD(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DD_VNNI 1
#define DD_DPBUSD(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#else
#define DD_VNNI 0
#endif

/* Running sums of u (unsigned levels) times x (signed activations) over a block: 16-bit lanes of
 * pair sums without VNNI (widened at the block's end by a8_widen), 32-bit lanes of quad sums with. */
static inline __attribute__((always_inline)) __m256i a8_acc(__m256i s, __m256i u, __m256i x) {
#if DD_VNNI
    return DD_DPBUSD(s, u, x);
#else
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x));
#endif
}

static inline __attribute__((always_inline)) __m256i a8_widen(__m256i s) {
#if DD_VNNI
    return s;
#else
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* s + the quad sums of u times x, in 32-bit lanes (a Q8_0 block's pair sums may not be added in 16 bits). */
static inline __attribute__((always_inline)) __m256i a8_acc32(__m256i s, __m256i u, __m256i x) {
#if DD_VNNI
    return DD_DPBUSD(s, u, x);
#else
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

/* One quad i (inputs 4i .. 4i + 3) of 4-bit levels L (32 bytes: byte 4o + j holds output o's level
 * in its low nibble and output o + 8's in its high one) into the running sums s0 (outputs 0-7) and
 * s1 (8-15) of rows [0, R); qx: the quad's first rounded activation of row 0, ``in`` apart. */
#define A8_NIBBLE_QUAD(R, L, qx, in, s0, s1)                                                        \
    do {                                                                                            \
        const __m256i lo_ = _mm256_and_si256(L, _mm256_set1_epi8(0x0F));                           \
        const __m256i hi_ = _mm256_and_si256(_mm256_srli_epi16(L, 4), _mm256_set1_epi8(0x0F));     \
        _Pragma("GCC unroll 8") for (int r_ = 0; r_ < (R); r_++) {                                  \
            const __m256i xb_ = bcast4((qx) + r_ * (in));                                           \
            s0[r_] = a8_acc(s0[r_], lo_, xb_);                                                      \
            s1[r_] = a8_acc(s1[r_], hi_, xb_);                                                      \
            /* keep each sum a running sum: unrolled, gcc would otherwise keep all 16R products   \
             * live and add them as a tree, spilling most of them */                             \
            __asm__("" : "+x"(s0[r_]), "+x"(s1[r_]));                                               \
        }                                                                                           \
    } while (0)

/* Rows [0, n) of x [n, in] -> qx [n, in] int8 and their scales dx [n, in / 32]; with sq, also
 * the integer sums of qx per block (per = 1: sq [n, in / 32]) or per 16 inputs (per = 2: sq
 * [n, in / 16]); the rounded values are within [-127, 127], so the packs below never saturate and
 * the sums of the 32-bit values are the sums of qx. */
static DD_UNUSED void quantise_rows_a8(const float *x, int64_t n, int64_t in, int8_t *qx, float *dx, int32_t *sq,
                                       int per) {
    const int64_t nb = in / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * in + b * 32;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            const float mx = hmax8(amax);
            const float d = mx / 127.0f, inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            dx[r * nb + b] = d;
            __m256i i32[4];
            for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
            _mm256_storeu_si256((__m256i *)(qx + r * in + b * 32), _mm256_permutevar8x32_epi32(p16, order));
            if (sq) { /* lanes 0-3 of h: inputs 0-15, 4-7: 16-31; then each half's sum in all its lanes */
                const __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                h = _mm_hadd_epi32(h, h);
                if (per == 2) {
                    sq[r * 2 * nb + 2 * b] = _mm_cvtsi128_si32(h);
                    sq[r * 2 * nb + 2 * b + 1] = _mm_extract_epi32(h, 1);
                } else {
                    sq[r * nb + b] = _mm_cvtsi128_si32(h) + _mm_extract_epi32(h, 1);
                }
            }
        }
}

/* The end of a block for one row: t += (d * dx) * sum + m * sx, 16 outputs. */
static inline __attribute__((always_inline)) void a8_block_end(const uint8_t *blk, float dxv, float sxv,
                                                               __m256i s0, __m256i s1, float *t) {
    const __m256 sc = _mm256_set1_ps(dxv), sxb = _mm256_set1_ps(sxv);
    __m256 t0 = _mm256_load_ps(t), t1 = _mm256_load_ps(t + 8);
    t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_widen(s0)), _mm256_mul_ps(half8(blk), sc), t0);
    t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_widen(s1)), _mm256_mul_ps(half8(blk + 16), sc), t1);
    _mm256_store_ps(t, _mm256_fmadd_ps(half8(blk + 32), sxb, t0));
    _mm256_store_ps(t + 8, _mm256_fmadd_ps(half8(blk + 48), sxb, t1));
}

static inline __attribute__((always_inline)) __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#ifndef A8_AHEAD
#define A8_AHEAD 2 /* blocks prefetched ahead (past a group's end: the next group's; a prefetch never faults). Measured
                     * (AMD EPYC, int8 model, forward after 256 tokens, medians of 25, 5 runs without and 3 with,
                     * alternating): 2 rows 7.5-8.1 -> 6.7-7.0 ms, 4 rows 9.8-10.9 -> 8.4-8.6, 8 rows 14.9-16.9 ->
                     * 13.5-13.7, 1 row 6.0-6.6 -> 6.1-6.3; 4 or 8 blocks ahead slowed 1 row (6.3-6.6) */
#endif

#ifndef A8_TILE_NIBBLES
#define A8_TILE_NIBBLES 6 /* rows per 8-lane pass of 4-bit levels (DD_Q4_1_A8, DD_Q4_K_A8): 2R running sums, the
                           * two level registers and a broadcast row (15 of the 16 vector registers at 6). Each
                           * further tile of a group unpacks its levels again and scales its blocks' ends anew */
#endif

/* Rows [0, R) of the rounded activations against group g (R = 1 .. the kind's tile); sq: the rows'
 * sums of qx per 16 inputs for DD_Q6_K_A8 (its zero points), else NULL. */
typedef void (*a8_pass)(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, const float *sx,
                        const int32_t *sq, float *y, int64_t ldy, int accumulate);
/* Rows [0, R) against groups [g, g + G) on 16 lanes (DD_WIDE_A8); sq: the rows' integer block sums of qx. */
typedef void (*a8_wide_pass)(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, const float *sx,
                             const int32_t *sq, float *y, int64_t ldy, int accumulate);

/* whether a kind's blocks have minimums, whose term needs the rows' fp32 block sums */
static inline int a8_minimums(int64_t kind) {
    return kind == DD_Q4_1_A8 || kind == DD_Q4_K_A8 || kind == DD_Q6_K_A8 || kind == DD_Q5_1_A8;
}

/* a8_gemm's buffers: the rounded rows qx, their scales dx and block sums sx (one allocation), and
 * with per the sums of qx per block (1) or per 16 inputs (2) */
static void a8_alloc(int64_t n, int64_t in, int per, int8_t **qx, float **dx, int32_t **sq) {
    const int64_t nb = in / 32;
    *qx = aligned_alloc(32, (size_t)((n * in + 31) / 32 * 32));
    *dx = malloc(sizeof(float) * (size_t)(2 * n * nb + 1));
    *sq = per ? malloc(sizeof(int32_t) * (size_t)(per * n * nb + 1)) : NULL;
}

/* Frees them after the last pass: each thread its own, or one thread the shared ones. */
static void a8_free(int shared, int8_t *qx, float *dx, int32_t *sq) {
    if (shared) {
        if (omp_get_thread_num() == 0) {
            free(sq);
            free(qx);
            free(dx);
        }
        return;
    }
    free(sq);
    free(qx);
    free(dx);
}

/* y (+)= x @ W^T for an 8-bit-activation kind inside a parallel region: every thread rounds
 * the rows itself (no sharing, no barrier), or from dd_share_rows rows on the threads round them
 * between them into one shared copy, and for Q4_1 take their block sums (the minimums' term);
 * then the groups are shared, each against balanced tiles of at most `tile` rows (7 = 4 + 3),
 * passes[rows - 1] running a tile. With `wide` (the 16-lane passes by groups and
 * rows) and a nonzero dd_wide_groups entry for n rows, each thread's groups (thread_groups) G at a
 * time against tiles of at most WIDE_TILE rows instead. */
static void a8_gemm(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc,
                    const a8_pass *passes, int64_t tile, const a8_wide_pass (*wide)[WIDE_TILE]) {
    const int64_t groups = (W->out + 15) / 16, nb = W->in / 32, in = W->in;
    /* DD_Q6_K_A8 multiplies its levels with their zero points and takes z * (sum of qx) back per 16 inputs */
    int per = W->kind == DD_Q6_K_A8 ? 2 : 0;
#if DD_WIDE_A8
    const int64_t G = wide ? wide_groups(W->kind, n) : 0;
    /* the 16-lane Q8_0 passes add 128 to the levels and take it back with the block sums of qx */
    if (G && W->kind == DD_Q8_0_A8) per = 1;
#else
    (void)wide;
#endif
    /* from dd_share_rows rows on, the threads round the rows between them into one shared copy; with
     * OpenMP's barriers (more threads than CPUs: dd_bars NULL) not before 8 rows, since its two extra
     * crossings cost more (4 threads on 2 CPUs: the forward over 4 tokens 1.19x as long sharing from 3) */
    const int64_t share_from = dd_bars || dd_share_rows > 8 ? dd_share_rows : 8;
    const int share = dd_share_rows > 0 && n >= share_from && omp_get_num_threads() > 1;
    int8_t *qx = NULL;
    float *dx = NULL;
    int32_t *sq = NULL;
    if (share && dd_bars) { /* thread 0 allocates, and hands the pointers over across a barrier */
        if (omp_get_thread_num() == 0) {
            a8_alloc(n, in, per, &qx, &dx, &sq);
            dd_bars->slot[0] = qx, dd_bars->slot[1] = dx, dd_bars->slot[2] = sq;
        }
        dd_sync();
        qx = dd_bars->slot[0], dx = dd_bars->slot[1], sq = dd_bars->slot[2];
    } else if (share) {
#pragma omp single copyprivate(qx, dx, sq)
        a8_alloc(n, in, per, &qx, &dx, &sq);
    } else {
        a8_alloc(n, in, per, &qx, &dx, &sq);
    }
    float *sx = dx + n * nb;
    if (share) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            quantise_rows_a8(x + r * in, 1, in, qx + r * in, dx + r * nb, sq ? sq + r * per * nb : NULL, per);
            if (a8_minimums(W->kind)) block_sums(x + r * in, 1, in, sx + r * nb);
        }
        dd_sync();
    } else {
        quantise_rows_a8(x, n, in, qx, dx, sq, per);
        if (a8_minimums(W->kind)) block_sums(x, n, in, sx);
    }
#if DD_WIDE_A8
    if (G) {
        const int64_t wtiles = (n + WIDE_TILE - 1) / WIDE_TILE;
        span_start(groups);
        int64_t g = -1, ng;
        while ((ng = span_next(groups, G, &g)) > 0) {
            for (int64_t t = 0, r = 0; t < wtiles; t++) {
                const int64_t rows = n / wtiles + (t < n % wtiles);
                wide[ng - 1][rows - 1](W, g, qx + r * in, dx + r * nb, sx + r * nb, sq ? sq + r * nb : NULL, y + r * ldy,
                                       ldy, acc);
                r += rows;
            }
        }
        dd_sync();
        a8_free(share, qx, dx, sq);
        return;
    }
#endif
    const int64_t tiles = (n + tile - 1) / tile;
    span_start(groups);
    for (int64_t g = -1; span_next(groups, 1, &g) > 0;)
        for (int64_t t = 0, r = 0; t < tiles; t++) {
            const int64_t rows = n / tiles + (t < n % tiles);
            passes[rows - 1](W, g, qx + r * in, dx + r * nb, sx + r * nb, sq ? sq + r * per * nb : NULL, y + r * ldy,
                             ldy, acc);
            r += rows;
        }
    dd_sync();
    a8_free(share, qx, dx, sq);
}

#if DD_WIDE_A8
/* The 16-lane passes for 8-bit activations: one vpdpbusd multiplies four inputs of 16 outputs
 * (a group) by one row's four rounded activations, where the 8-lane passes take two. Lane o
 * holds output o; the integer sums are exact (any order gives the same integers), and each
 * lane's block end is the 8-lane passes' float arithmetic, so the results are the same bits.
 * Levels of quad i (inputs 4i .. 4i + 3) as 16 lanes of 4 unsigned bytes:
 *   DD_Q4_1_A8: the quad's 32 bytes in both halves, the low nibbles kept in lanes 0-7 (outputs
 *     0-7) and the high ones in lanes 8-15 (outputs 8-15);
 *   DD_Q8_0_A8: the quad's 64 bytes (outputs 0-7, then 8-15) plus 128 (vpdpbusd's unsigned
 *     operand): the sum then holds 128 * (the row's block sum of qx) too, which its running sum
 *     starts without (sq). */
#define A8_BYTES(KIND_ID) BLOCK_BYTES((KIND_ID) == DD_Q4_1_A8 ? DD_Q4_1 : DD_Q8_0)
static inline __attribute__((always_inline)) __m512i a8_levels16(int64_t kind, const uint8_t *blk, int i) {
    if (kind == DD_Q4_1_A8) {
        const __m512i L = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * i)));
#if defined(__GFNI__)
        /* one affine map per byte: each byte's low nibble in the low half, its high nibble (>> 4) in
         * the high half (NIBBLE_LOW, NIBBLE_HIGH) */
        return _mm512_gf2p8affine_epi64_epi8(L, _mm512_setr_epi64(NIBBLE_LOW, NIBBLE_LOW, NIBBLE_LOW, NIBBLE_LOW,
                                                                  NIBBLE_HIGH, NIBBLE_HIGH, NIBBLE_HIGH, NIBBLE_HIGH), 0);
#else
        return _mm512_and_si512(_mm512_srlv_epi64(L, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)), _mm512_set1_epi8(0x0F));
#endif
    }
    return _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + 32 + 64 * i)), _mm512_set1_epi8((char)0x80));
}

/* Rows [0, R) against groups [g, g + G): per block R * G integer sums in registers (two per
 * output, even and odd quads, when R * G <= 2: independent chains), the scaled totals in memory. */
#define AWPASS(KIND_ID, KIND, R, G)                                                                 \
    static void awpass_##KIND##_##R##_##G(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, \
                                          const float *sx, const int32_t *sq, float *y, int64_t ldy, int accumulate) { \
        enum { C = R * G <= 2 ? 2 : 1, BYTES = A8_BYTES(KIND_ID) };                                 \
        const int64_t nb = W->in / 32, in = W->in, next = nb * BYTES;                               \
        float tot[R * G * 16] __attribute__((aligned(64)));                                         \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BYTES;                                      \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                                     \
                for (int l = 0; l < BYTES; l += 64) _mm_prefetch((const char *)blk + j * next + A8_AHEAD * BYTES + l, _MM_HINT_T0); \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) PREFETCH_AHEAD(R, blk + j * next, BYTES); \
            __m512i s[C][R * G];                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const __m512i s0 = KIND_ID == DD_Q8_0_A8 ? _mm512_set1_epi32(-128 * sq[r * nb + b]) : _mm512_setzero_si512(); \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                               \
                    s[0][r * G + j] = s0;                                                           \
                    if (C == 2) s[C - 1][r * G + j] = _mm512_setzero_si512();                       \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                   \
                __m512i q[G];                                                                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) q[j] = a8_levels16(KIND_ID, blk + j * next, i); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    int32_t v;                                                                      \
                    memcpy(&v, qx + r * in + b * 32 + 4 * i, 4);                                    \
                    const __m512i xb = _mm512_set1_epi32(v);                                        \
                    _Pragma("GCC unroll 4") for (int j = 0; j < G; j++)                             \
                        s[i % C][r * G + j] = _mm512_dpbusd_epi32(s[i % C][r * G + j], q[j], xb);   \
                }                                                                                   \
            }                                                                                       \
            __m512 dv[G], mv[G];                                                                    \
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                                   \
                dv[j] = half16(blk + j * next);                                                     \
                mv[j] = KIND_ID == DD_Q4_1_A8 ? half16(blk + j * next + 32) : dv[j];                \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const __m512 sc = _mm512_set1_ps(dx[r * nb + b]);                                   \
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) {                               \
                    float *t = tot + (r * G + j) * 16;                                              \
                    const __m512i si = C == 2 ? _mm512_add_epi32(s[0][r * G + j], s[C - 1][r * G + j]) : s[0][r * G + j]; \
                    __m512 tv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(dv[j], sc), _mm512_load_ps(t)); \
                    if (KIND_ID == DD_Q4_1_A8) tv = _mm512_fmadd_ps(mv[j], _mm512_set1_ps(sx[r * nb + b]), tv); \
                    _mm512_store_ps(t, tv);                                                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < G; j++) store_outputs(W, g + j, tot + (r * G + j) * 16, y + r * ldy, accumulate); \
    }

#define AWPASSES(KIND_ID, KIND)                                                                     \
    AWPASS(KIND_ID, KIND, 1, 1) AWPASS(KIND_ID, KIND, 2, 1) AWPASS(KIND_ID, KIND, 3, 1) AWPASS(KIND_ID, KIND, 4, 1) \
    AWPASS(KIND_ID, KIND, 5, 1) AWPASS(KIND_ID, KIND, 6, 1) AWPASS(KIND_ID, KIND, 7, 1) AWPASS(KIND_ID, KIND, 8, 1) \
    AWPASS(KIND_ID, KIND, 1, 2) AWPASS(KIND_ID, KIND, 2, 2) AWPASS(KIND_ID, KIND, 3, 2) AWPASS(KIND_ID, KIND, 4, 2) \
    AWPASS(KIND_ID, KIND, 5, 2) AWPASS(KIND_ID, KIND, 6, 2) AWPASS(KIND_ID, KIND, 7, 2) AWPASS(KIND_ID, KIND, 8, 2) \
    AWPASS(KIND_ID, KIND, 1, 3) AWPASS(KIND_ID, KIND, 2, 3) AWPASS(KIND_ID, KIND, 3, 3) AWPASS(KIND_ID, KIND, 4, 3) \
    AWPASS(KIND_ID, KIND, 5, 3) AWPASS(KIND_ID, KIND, 6, 3) AWPASS(KIND_ID, KIND, 7, 3) AWPASS(KIND_ID, KIND, 8, 3) \
    AWPASS(KIND_ID, KIND, 1, 4) AWPASS(KIND_ID, KIND, 2, 4)                                         \
    static const a8_wide_pass a8_wide_##KIND[4][WIDE_TILE] = {                                      \
        {awpass_##KIND##_1_1, awpass_##KIND##_2_1, awpass_##KIND##_3_1, awpass_##KIND##_4_1,        \
         awpass_##KIND##_5_1, awpass_##KIND##_6_1, awpass_##KIND##_7_1, awpass_##KIND##_8_1},       \
        {awpass_##KIND##_1_2, awpass_##KIND##_2_2, awpass_##KIND##_3_2, awpass_##KIND##_4_2,        \
         awpass_##KIND##_5_2, awpass_##KIND##_6_2, awpass_##KIND##_7_2, awpass_##KIND##_8_2},       \
        {awpass_##KIND##_1_3, awpass_##KIND##_2_3, awpass_##KIND##_3_3, awpass_##KIND##_4_3,        \
         awpass_##KIND##_5_3, awpass_##KIND##_6_3, awpass_##KIND##_7_3, awpass_##KIND##_8_3},       \
        {awpass_##KIND##_1_4, awpass_##KIND##_2_4}};
#define A8_WIDE(KIND) a8_wide_##KIND
#else
#define AWPASSES(KIND_ID, KIND)
#define A8_WIDE(KIND) NULL
#endif

#endif /* DD_A8_H */
