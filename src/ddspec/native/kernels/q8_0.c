/* Q8_0 weights: with fp32 activations (dd_mm_q8_0: the 8-lane passes of quant.h and, with AVX-512,
 * the 16-lane ones) and with 8-bit activations (dd_mm_q8_0a8: QAPASS here, the 16-lane AWPASSES of a8.h). */
#include "quant.h"
#include "a8.h"

QPASSES(DD_Q8_0, q8_0)
QGEMM(DD_Q8_0, q8_0)

/* DD_Q8_0_A8: a Q8_0 weight with 8-bit activations (the rounding of DD_Q4_1_A8). vpmaddubsw
 * needs one unsigned operand: it multiplies |q| by the activation carrying q's sign, and the
 * pair sums (at most 2 * 127 * 127 < 2^15) go to 32 bits at once. Layout per (group, block),
 * 544 bytes: 16 d (fp16), then per quad i of 4 inputs 32 bytes for outputs 0-7 (byte 4o + j =
 * q(o, 4i + j)) and 32 for outputs 8-15. */
#define QAPASS(R)                                                                                   \
    static void qapass_##R(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx,       \
                           const float *sx, const int32_t *sq, float *y, int64_t ldy, int accumulate) { \
        (void)sq;                                                                                   \
        (void)sx; /* no minimum in Q8_0 */                                                          \
        const int64_t nb = W->in / 32, in = W->in;                                                  \
        enum { BYTES = BLOCK_BYTES(DD_Q8_0) };                                                      \
        __m256 t0[R], t1[R];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) t0[r] = t1[r] = _mm256_setzero_ps();    \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BYTES;                                      \
            for (int l = 0; l < BYTES; l += 64) _mm_prefetch((const char *)blk + A8_AHEAD * BYTES + l, _MM_HINT_T0); \
            PREFETCH_AHEAD(R, blk, BYTES);                                                          \
            __m256i s0[R], s1[R];                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256(); \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                   \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * i));        \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 64 * i));        \
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256i xb = bcast4(qx + r * in + b * 32 + 4 * i);                        \
                    s0[r] = a8_acc32(s0[r], a0, _mm256_sign_epi8(xb, w0));                          \
                    s1[r] = a8_acc32(s1[r], a1, _mm256_sign_epi8(xb, w1));                          \
                    __asm__("" : "+x"(s0[r]), "+x"(s1[r])); /* running sums (see APASS) */           \
                }                                                                                   \
            }                                                                                       \
            const __m256 dw0 = half8(blk), dw1 = half8(blk + 16);                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                const __m256 sc = _mm256_set1_ps(dx[r * nb + b]);                                   \
                t0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), _mm256_mul_ps(dw0, sc), t0[r]);  \
                t1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), _mm256_mul_ps(dw1, sc), t1[r]);  \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
            store_group(W, g, t0[r], t1[r], y + r * ldy, accumulate);                               \
    }
QAPASS(1) QAPASS(2) QAPASS(3)
AWPASSES(DD_Q8_0_A8, q8_0a8)

DD_HIDDEN void dd_mm_q8_0a8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    static const a8_pass passes[3] = {qapass_1, qapass_2, qapass_3};
    a8_gemm(W, x, n, y, ldy, acc, passes, 3, A8_WIDE(q8_0a8));
}
