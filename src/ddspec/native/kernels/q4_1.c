/* Q4_1 weights: with fp32 activations (dd_mm_q4_1: the 8-lane passes of quant.h and, with AVX-512,
 * the 16-lane ones) and with 8-bit activations (dd_mm_q4_1a8: APASS here, the 16-lane AWPASSES of a8.h). */
#include "quant.h"
#include "a8.h"

QPASSES(DD_Q4_1, q4_1)
QGEMM(DD_Q4_1, q4_1)

/* DD_Q4_1_A8: a Q4_1 weight multiplied with its activations rounded to 8 bits, as llama.cpp
 * does (its Q8_1 activation blocks). Per row and block of 32 inputs, x ~ dx * qx with
 * dx = max|x| / 127 and qx = round(x / dx) in [-127, 127]; then for each output
 * sum x*w ~ d * dx * sum(q * qx) + m * sx, the integer sum exact (vpmaddubsw: 32 products of a
 * 4-bit level and an 8-bit activation per instruction, pairs summed to 16 bits, eight of them
 * summed to at most 8 * 2 * 15 * 127 = 30480 < 2^15, then to 32 bits), sx the block's fp32 sum
 * of x. The rounding of x makes this a different (coarser) model than DD_Q4_1's, but one whose
 * rows are exact integers until the per-block scaling, which runs in the same order for every
 * row: a row's result is still the same bit for bit alone or inside a tree.
 *
 * Layout per (group, block), 320 bytes: 16 d, 16 m (fp16), then for each quad i of 4 inputs
 * (k = 4i .. 4i + 3) 32 bytes, byte 4o + j = q(output o, 4i + j) | q(output o + 8, 4i + j) << 4:
 * one load and three ops rebuild 8 outputs x 4 inputs of levels twice (outputs 0-7, 8-15). */

/* Rows [0, R) against group g: 2R integer sums in registers per block, the scaled totals in
 * memory (16 vector registers hold the sums, the levels and a broadcast row, no more). */
#define APASS(R)                                                                                    \
    static void apass_##R(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx,        \
                          const float *sx, const int32_t *sq, float *y, int64_t ldy, int accumulate) { \
        (void)sq;                                                                                   \
        const int64_t nb = W->in / 32, in = W->in;                                                  \
        enum { BYTES = BLOCK_BYTES(DD_Q4_1) };                                                      \
        float tot[R * 16] __attribute__((aligned(32)));                                             \
        memset(tot, 0, sizeof(tot));                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const uint8_t *blk = W->qs + (g * nb + b) * BYTES;                                      \
            for (int l = 0; l < BYTES; l += 64) _mm_prefetch((const char *)blk + A8_AHEAD * BYTES + l, _MM_HINT_T0); \
            PREFETCH_AHEAD(R, blk, BYTES);                                                          \
            __m256i s0[R], s1[R];                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256(); \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                   \
                const __m256i L = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * i));         \
                A8_NIBBLE_QUAD(R, L, qx + b * 32 + 4 * i, in, s0, s1);                              \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                a8_block_end(blk, dx[r * nb + b], sx[r * nb + b], s0[r], s1[r], tot + r * 16);      \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
            store_group(W, g, _mm256_load_ps(tot + r * 16), _mm256_load_ps(tot + r * 16 + 8), y + r * ldy, accumulate); \
    }
APASS(1) APASS(2) APASS(3) APASS(4) APASS(5) APASS(6)
AWPASSES(DD_Q4_1_A8, q4_1a8)

DD_HIDDEN void dd_mm_q4_1a8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    static const a8_pass passes[6] = {apass_1, apass_2, apass_3, apass_4, apass_5, apass_6};
    a8_gemm(W, x, n, y, ldy, acc, passes, A8_TILE_NIBBLES, A8_WIDE(q4_1a8));
}
