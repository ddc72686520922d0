/* How many cycles the 8-bit-activation Q4_1 matmul pass spends per row and group-block (16 outputs x
 * 32 inputs), with its weights and activations in L1, on one thread; and how many of them are the
 * integer dot products alone. Built and run by scripts/pass_cycles.py with the flags of ddspec's own
 * build; it includes the kernels' Q4_1 file (native/kernels/q4_1.c, ddspec.native.SOURCE) itself, so the
 * pass timed is the one the model runs.
 *
 *   pass:       the kernel's pass as it is (levels widened, dot products, GGUF block end)
 *   sums only:  the same loop without the block end (each block's integer sums folded into a
 *               register): what the format's per-block scaling costs is the difference
 *
 * The widest pass this build has: the 16-lane one (AVX-512 VNNI) over 8 rows x 2 groups, else the
 * 8-lane one over 4 rows. Output: the pass timed, the time-stamp counter's rate, then one line per
 * repetition, "pass <cycles> sums <cycles>" in counter cycles per row and group-block. */
#include DD_SOURCE
/* what q4_1.c's matmuls read that the library defines elsewhere (gemm.c): unused here, where the
 * passes are called directly, but linked */
DD_HIDDEN __thread dd_span *dd_spans;
DD_HIDDEN __thread dd_bar *dd_bars;
DD_HIDDEN int dd_span_delay_us = 0;
DD_HIDDEN int64_t dd_groups_taken = 0;
DD_HIDDEN int8_t dd_wide_groups[4][WIDE_TILE];
DD_HIDDEN int dd_prefetch_blocks = 0;
DD_HIDDEN int dd_share_rows = 3;
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>

#define NB 18 /* blocks per row: the default model's 576 inputs */
#define IN (NB * 32)
#define GROUPS 4 /* 4 groups x 18 blocks x 320 bytes = 23 KB of levels: in L1 with the rows */
#if DD_WIDE_A8
#define R 8
#define G 2
#define PASS(W, g, qx, dx, sx, sq, y) awpass_q4_1a8_8_2(W, g, qx, dx, sx, sq, y, GROUPS * 16, 0)
#define LANES "16"
/* the 16-lane pass's loop (AWPASS, C = 1) without its block end */
static __attribute__((noinline)) void sums_only(const dd_weight *W, int64_t g, const int8_t *qx, int32_t *out) {
    const int64_t next = NB * 320;
    __m512i keep[R * G];
    for (int k = 0; k < R * G; k++) keep[k] = _mm512_setzero_si512();
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = W->qs + (g * NB + b) * 320;
        __m512i s[R * G];
        for (int k = 0; k < R * G; k++) s[k] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
            __m512i q[G];
            _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) q[j] = a8_levels16(DD_Q4_1_A8, blk + j * next, i);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                int32_t v;
                memcpy(&v, qx + r * IN + b * 32 + 4 * i, 4);
                const __m512i xb = _mm512_set1_epi32(v);
                _Pragma("GCC unroll 4") for (int j = 0; j < G; j++) s[r * G + j] = _mm512_dpbusd_epi32(s[r * G + j], q[j], xb);
            }
        }
        for (int k = 0; k < R * G; k++) keep[k] = _mm512_xor_si512(keep[k], s[k]);
    }
    for (int k = 0; k < R * G; k++) _mm512_storeu_si512(out + 16 * k, keep[k]);
}
#else
#define R 4
#define G 1
#define PASS(W, g, qx, dx, sx, sq, y) apass_4(W, g, qx, dx, sx, y, GROUPS * 16, 0)
#define LANES "8"
/* the 8-lane pass's loop (APASS) without its block end */
static __attribute__((noinline)) void sums_only(const dd_weight *W, int64_t g, const int8_t *qx, int32_t *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i keep[2 * R];
    for (int k = 0; k < 2 * R; k++) keep[k] = _mm256_setzero_si256();
    for (int64_t b = 0; b < NB; b++) {
        const uint8_t *blk = W->qs + (g * NB + b) * 320;
        __m256i s0[R], s1[R];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
            const __m256i L = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * i));
            const __m256i lo = _mm256_and_si256(L, low), hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), low);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                const __m256i xb = bcast4(qx + r * IN + b * 32 + 4 * i);
                s0[r] = a8_acc(s0[r], lo, xb);
                s1[r] = a8_acc(s1[r], hi, xb);
                __asm__("" : "+x"(s0[r]), "+x"(s1[r]));
            }
        }
        for (int r = 0; r < R; r++) {
            keep[2 * r] = _mm256_xor_si256(keep[2 * r], a8_widen(s0[r]));
            keep[2 * r + 1] = _mm256_xor_si256(keep[2 * r + 1], a8_widen(s1[r]));
        }
    }
    for (int k = 0; k < 2 * R; k++) _mm256_storeu_si256((__m256i *)(out + 8 * k), keep[k]);
}
#endif

int main(int argc, char **argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 20000, reps = argc > 2 ? atoi(argv[2]) : 5;
    uint8_t *qs = aligned_alloc(64, GROUPS * NB * 320);
    srand(1);
    for (int i = 0; i < GROUPS * NB * 320; i++) qs[i] = (uint8_t)rand();
    for (int blk = 0; blk < GROUPS * NB; blk++) /* scales and minimums: fp16 values near 1 */
        for (int k = 0; k < 32; k++) ((uint16_t *)(qs + blk * 320))[k] = (uint16_t)(0x3c00 + (rand() & 0xff));
    const dd_weight W = {DD_Q4_1_A8, GROUPS * 16, IN, NULL, qs, NULL, NULL, NULL};
    int8_t *qx = aligned_alloc(64, R * IN);
    for (int i = 0; i < R * IN; i++) qx[i] = (int8_t)(rand() % 255 - 127);
    float dx[R * NB], sx[R * NB];
    int32_t sq[R * NB];
    for (int i = 0; i < R * NB; i++) dx[i] = 0.01f, sx[i] = 0.1f, sq[i] = 0;
    float *y = aligned_alloc(64, R * GROUPS * 16 * sizeof(float));
    int32_t *sums = aligned_alloc(64, R * G * 16 * sizeof(int32_t));
    dd_prefetch_blocks = 0; /* nothing to prefetch: everything is in L1 */
    const double units = (double)iters * (GROUPS / G) * R * G * NB; /* rows x group-blocks */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    const uint64_t c0 = __rdtsc();
    do clock_gettime(CLOCK_MONOTONIC, &b); while ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec) < 0.2);
    const double hz = (__rdtsc() - c0) / ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec));
    printf("the %s-lane pass over %d rows x %d group%s\nhz %.6g\n", LANES, R, G, G == 1 ? "" : "s", hz);
    int64_t check = 0;
    for (int rep = 0; rep < reps; rep++) {
        const uint64_t t0 = __rdtsc();
        for (int it = 0; it < iters; it++)
            for (int g = 0; g < GROUPS; g += G) PASS(&W, g, qx, dx, sx, sq, y);
        const uint64_t t1 = __rdtsc();
        for (int it = 0; it < iters; it++)
            for (int g = 0; g < GROUPS; g += G) sums_only(&W, g, qx, sums);
        const uint64_t t2 = __rdtsc();
        check += (int64_t)y[0] + sums[0];
        printf("pass %.3f sums %.3f\n", (t1 - t0) / units, (t2 - t1) / units);
    }
    fprintf(stderr, "checksum %lld\n", (long long)check);
    return 0;
}
