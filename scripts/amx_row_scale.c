/* An experiment, not part of ddspec: matmuls on 8-bit weights with one scale per output row, on AMX
 * tiles (integer sums over all the inputs, one scale per row and output at the end), to compare with
 * ddspec's GGUF-block kernels, whose scale every 32 inputs cuts each tile product to 32 deep.
 * Built and timed by scripts/amx_row_scale.py (random weights of the model's shapes: the timing
 * does not depend on the values; amx_sweep's results are checked there against torch). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <sys/syscall.h>
#ifndef PF
#define PF 2 /* 1 KB tiles of weights prefetched this many chunks of 64 inputs ahead (0, 2, 4, 8 timed: 2 best) */
#endif
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* Linux grants a process the tile state on request: 0 when granted. */
int amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* W packed: for each block of 16 outputs, for each chunk of 64 inputs, 16 x 64 bytes: row i holds
 * output c's 4 bytes of inputs 4i..4i+3 at 4c (AMX's B layout). */
void amx_pack(const int8_t *w /* [out, in] */, int64_t out, int64_t in, int8_t *p) {
    for (int64_t cb = 0; cb < out / 16; cb++)
        for (int64_t kc = 0; kc < in / 64; kc++) {
            int8_t *t = p + (cb * (in / 64) + kc) * 1024;
            for (int i = 0; i < 16; i++)
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < 4; j++) t[i * 64 + c * 4 + j] = w[(cb * 16 + c) * in + kc * 64 + 4 * i + j];
        }
}

static void config(int rows) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }   /* C tiles: rows x 16 int32 */
    cfg.rows[4] = rows; cfg.colsb[4] = 64;                                        /* A: rows x 64 bytes */
    cfg.rows[5] = 16; cfg.colsb[5] = 64;                                          /* B */
    cfg.rows[6] = 16; cfg.colsb[6] = 64;
    cfg.rows[7] = 16; cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
}

/* y[n, out] = x[n, in] @ W^T for each weight in turn (the same x, rounded to 8 bits again for each
 * weight, one scale per row, as a forward rounds each matmul's input), in one parallel region;
 * n <= 16 rows (one tile's height), each thread taking 4 blocks of 16 outputs at a time; y's rows
 * are out wide for each weight in turn (the last one's stay). */
int amx_sweep(const int8_t *const *W, const float *const *ws, const int64_t *outs, int64_t count, int64_t in,
              const float *x, int64_t n, float *y, int nthreads) {
    if (n < 1 || n > 16 || in % 64) return 1;
    int8_t qx[16 * 4096] __attribute__((aligned(64)));
    float sx[16];
#pragma omp parallel num_threads(nthreads)
    {
        config((int)n);
        int32_t cbuf[4][16 * 16] __attribute__((aligned(64)));
        for (int64_t w = 0; w < count; w++) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                __m512 m = _mm512_setzero_ps();
                for (int64_t k = 0; k < in; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + r * in + k)));
                const float mx = _mm512_reduce_max_ps(m);
                sx[r] = mx / 127.0f;
                const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.0f / mx : 0);
                for (int64_t k = 0; k < in; k += 16)
                    _mm_storeu_si128((__m128i *)(qx + r * in + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + r * in + k), inv))));
            }
            const int64_t blocks = outs[w] / 16, groups = (blocks + 3) / 4, kcs = in / 64;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t cb0 = g * 4, nb = blocks - cb0 < 4 ? blocks - cb0 : 4;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const int8_t *base = W[w] + cb0 * kcs * 1024;
                for (int64_t kc = 0; kc < kcs; kc++) {
                    if (PF) for (int64_t b = 0; b < nb; b++) {
                        const char *p = (const char *)(base + (b * kcs + kc + PF) * 1024);
                        for (int l = 0; l < 1024; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
                    }
                    _tile_loadd(4, qx + kc * 64, in);
                    _tile_loadd(5, base + (0 * kcs + kc) * 1024, 64); _tile_dpbssd(0, 4, 5);
                    if (nb > 1) { _tile_loadd(6, base + (1 * kcs + kc) * 1024, 64); _tile_dpbssd(1, 4, 6); }
                    if (nb > 2) { _tile_loadd(7, base + (2 * kcs + kc) * 1024, 64); _tile_dpbssd(2, 4, 7); }
                    if (nb > 3) { _tile_loadd(5, base + (3 * kcs + kc) * 1024, 64); _tile_dpbssd(3, 4, 5); }
                }
                _tile_stored(0, cbuf[0], 64); _tile_stored(1, cbuf[1], 64); _tile_stored(2, cbuf[2], 64); _tile_stored(3, cbuf[3], 64);
                for (int64_t b = 0; b < nb; b++) {
                    const float *s = ws[w] + (cb0 + b) * 16;
                    for (int64_t r = 0; r < n; r++) {
                        const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf[b] + r * 16));
                        _mm512_storeu_ps(y + r * outs[w] + (cb0 + b) * 16, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(sx[r]))));
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}
