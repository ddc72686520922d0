/* The dense kinds' passes (fp32, and fp16 / bf16 holding fp32 values exactly), as macros that
 * f32.c and half.c instantiate per kind: PASSES(kind id, name) then DGEMM(name) define dd_mm_<name>. */
#ifndef DD_DENSE_H
#define DD_DENSE_H
#include "common.h"

/* Group g's 16 weights at input k of a dense weight (fp32, or fp16 / bf16 holding fp32 values
 * exactly), as two vectors (outputs 0-7, 8-15). */
static inline __attribute__((always_inline)) void weights_at(const dd_weight *W, int64_t g, int64_t k, __m256 *w0, __m256 *w1) {
    const int64_t in = W->in;
    if (W->kind == DD_F16) {
        const uint16_t *p = (const uint16_t *)W->w + (g * in + k) * 16;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    } else if (W->kind == DD_BF16) {
        const uint16_t *p = (const uint16_t *)W->w + (g * in + k) * 16;
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16));
    } else {
        const float *p = W->w + (g * in + k) * 16;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    }
}

/* Rows [0, R) of x against group g (2R accumulators). */
#define PASS(KIND_ID, KIND, R)                                                                      \
    static void pass_##KIND##_##R(const dd_weight *W, int64_t g, const float *x, int64_t ldx,       \
                                  float *y, int64_t ldy, int accumulate) {                          \
        __m256 a0[R], a1[R];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();    \
        const dd_weight Wk = {KIND_ID, W->out, W->in, W->w, W->qs, W->d, W->m, W->bias};            \
        for (int64_t k = 0; k < W->in; k++) {                                                       \
            __m256 w0, w1;                                                                          \
            weights_at(&Wk, g, k, &w0, &w1);                                                        \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);                             \
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);                                             \
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);                                             \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)  /* unrolled: the sums stay in registers */ \
            store_group(W, g, a0[r], a1[r], y + r * ldy, accumulate);                               \
    }

/* One row against groups g and g + 1: four independent chains instead of two. */
#define PASS1X2(KIND_ID, KIND)                                                                      \
    static void pass_##KIND##_1x2(const dd_weight *W, int64_t g, const float *x, float *y, int accumulate) { \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;                                 \
        const dd_weight Wk = {KIND_ID, W->out, W->in, W->w, W->qs, W->d, W->m, W->bias};            \
        for (int64_t k = 0; k < W->in; k++) {                                                       \
            __m256 w0, w1, v0, v1;                                                                  \
            weights_at(&Wk, g, k, &w0, &w1);                                                        \
            weights_at(&Wk, g + 1, k, &v0, &v1);                                                    \
            const __m256 xv = _mm256_broadcast_ss(x + k);                                           \
            a0 = _mm256_fmadd_ps(xv, w0, a0);                                                       \
            a1 = _mm256_fmadd_ps(xv, w1, a1);                                                       \
            b0 = _mm256_fmadd_ps(xv, v0, b0);                                                       \
            b1 = _mm256_fmadd_ps(xv, v1, b1);                                                       \
        }                                                                                           \
        store_group(W, g, a0, a1, y, accumulate);                                                   \
        store_group(W, g + 1, b0, b1, y, accumulate);                                               \
    }

/* Rows [0, R) against one block of 32 inputs of a group, its weights already rebuilt in
 * buf [32][16]; the sums live in acc [R][16] between blocks (stored and reloaded exactly, so
 * each lane still sums in order of k). Many rows then share one rebuild of the weights. */
#define BUF_TILE(R)                                                                                 \
    static inline void buf_tile_##R(const float *buf, const float *x, int64_t ldx, float *acc) {   \
        __m256 a0[R], a1[R];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
            a0[r] = _mm256_loadu_ps(acc + r * 16);                                                  \
            a1[r] = _mm256_loadu_ps(acc + r * 16 + 8);                                              \
        }                                                                                           \
        for (int k = 0; k < 32; k++) {                                                              \
            const __m256 w0 = _mm256_load_ps(buf + k * 16), w1 = _mm256_load_ps(buf + k * 16 + 8); \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);                             \
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);                                             \
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);                                             \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
            _mm256_storeu_ps(acc + r * 16, a0[r]);                                                  \
            _mm256_storeu_ps(acc + r * 16 + 8, a1[r]);                                              \
        }                                                                                           \
    }
BUF_TILE(1) BUF_TILE(2) BUF_TILE(3) BUF_TILE(4) BUF_TILE(5) BUF_TILE(6)

/* All n rows (n > TILE) against group g, rebuilding each block of weights once. */
#define BUFFERED(KIND_ID, KIND)                                                                     \
    static void buffered_##KIND(const dd_weight *W, int64_t g, const float *x, int64_t n,          \
                                float *y, int64_t ldy, int accumulate, float *acc) {                \
        float buf[32 * 16] __attribute__((aligned(32)));                                           \
        const dd_weight Wk = {KIND_ID, W->out, W->in, W->w, W->qs, W->d, W->m, W->bias};            \
        const int64_t ldx = W->in;                                                                  \
        memset(acc, 0, sizeof(float) * 16 * (size_t)n);                                            \
        for (int64_t k0 = 0; k0 < W->in; k0 += 32) {                                                \
            for (int k = 0; k < 32; k++) {                                                          \
                __m256 w0, w1;                                                                      \
                weights_at(&Wk, g, k0 + k, &w0, &w1);                                               \
                _mm256_store_ps(buf + k * 16, w0);                                                  \
                _mm256_store_ps(buf + k * 16 + 8, w1);                                              \
            }                                                                                       \
            const int64_t tiles = (n + TILE - 1) / TILE; /* balanced: 7 rows = 4 + 3, not 6 + 1 */      \
            for (int64_t t = 0, r = 0; t < tiles; t++) {                                            \
                const int64_t rows = n / tiles + (t < n % tiles);                                   \
                const float *xr = x + r * ldx + k0;                                                 \
                float *ar = acc + r * 16;                                                           \
                switch (rows) {                                                                     \
                case 1: buf_tile_1(buf, xr, ldx, ar); break;                                        \
                case 2: buf_tile_2(buf, xr, ldx, ar); break;                                        \
                case 3: buf_tile_3(buf, xr, ldx, ar); break;                                        \
                case 4: buf_tile_4(buf, xr, ldx, ar); break;                                        \
                case 5: buf_tile_5(buf, xr, ldx, ar); break;                                        \
                default: buf_tile_6(buf, xr, ldx, ar); break;                                       \
                }                                                                                   \
                r += rows;                                                                          \
            }                                                                                       \
        }                                                                                           \
        for (int64_t r = 0; r < n; r++)                                                             \
            store_group(W, g, _mm256_loadu_ps(acc + r * 16), _mm256_loadu_ps(acc + r * 16 + 8), y + r * ldy, accumulate); \
    }

#define PASSES(KIND_ID, KIND)                                                                       \
    PASS(KIND_ID, KIND, 1) PASS(KIND_ID, KIND, 2) PASS(KIND_ID, KIND, 3) PASS(KIND_ID, KIND, 4)     \
    PASS(KIND_ID, KIND, 5) PASS(KIND_ID, KIND, 6) PASS1X2(KIND_ID, KIND) BUFFERED(KIND_ID, KIND)    \
    /* all n rows against groups [g, g + ng), ng = 1 or 2 */                                        \
    static void groups_##KIND(const dd_weight *W, int64_t g, int ng, const float *x, int64_t n,    \
                              float *y, int64_t ldy, int acc) {                                     \
        const int64_t ldx = W->in;                                                                  \
        for (int j = 0; j < ng; j++) {                                                              \
            const int64_t gg = g + j;                                                               \
            int64_t r = 0;                                                                          \
            if (ng == 2 && n == 1) { /* one row: two groups per pass, twice the chains */           \
                pass_##KIND##_1x2(W, g, x, y, acc);                                                 \
                break;                                                                              \
            }                                                                                       \
            for (; r + TILE <= n; r += TILE) pass_##KIND##_6(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); \
            switch (n - r) {                                                                        \
            case 1: pass_##KIND##_1(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); break;       \
            case 2: pass_##KIND##_2(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); break;       \
            case 3: pass_##KIND##_3(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); break;       \
            case 4: pass_##KIND##_4(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); break;       \
            case 5: pass_##KIND##_5(W, gg, x + r * ldx, ldx, y + r * ldy, ldy, acc); break;       \
            default: break;                                                                         \
            }                                                                                       \
        }                                                                                           \
    }

/* Dense y (+)= x @ W^T inside a parallel region (see dd_matmul), one function per kind. */
#define DGEMM(KIND)                                                                                 \
DD_HIDDEN void dd_mm_##KIND(const dd_weight *W, const float *x, int64_t n, float *y,   \
                                        int64_t ldy, int acc) {                                     \
    const int64_t groups = (W->out + 15) / 16, pairs = (groups + 1) / 2;                            \
    if (n > BUFFER_FROM && W->in % 32 == 0) { /* many rows: read (and rebuild) each block once */  \
        float *sums = malloc(sizeof(float) * 16 * (size_t)n);                                       \
        span_start(groups);                                                                         \
        for (int64_t g = -1; span_next(groups, 1, &g) > 0;) buffered_##KIND(W, g, x, n, y, ldy, acc, sums); \
    dd_sync();                                                                                      \
        free(sums);                                                                                 \
        return;                                                                                     \
    }                                                                                               \
    span_start(pairs);                                                                              \
    for (int64_t p = -1; span_next(pairs, 1, &p) > 0;) {                                            \
        const int64_t g = 2 * p;                                                                    \
        groups_##KIND(W, g, g + 1 < groups ? 2 : 1, x, n, y, ldy, acc);                             \
    }                                                                                               \
    dd_sync();                                                                                      \
}

#endif /* DD_DENSE_H */
