/* The rest: the draft's scores (dd_top_logprobs) and the benchmark's floors (dd_int8_peak,
 * dd_read_sum). */
#include "common.h"

/* The CPU's 8-bit multiply-add rate, for the benchmark's compute floor: `iters` rounds, in each
 * of `nthreads` threads, of 12 independent steps of the int8-activation kernels' widest inner
 * instruction on registers, no memory (dd_int8_peak_step: 0 = vpmaddubsw + a 16-bit add on 8
 * lanes, 32 multiply-adds; 1 = vpdpbusd on 8 lanes, 32; 2 = vpdpbusd on 16 lanes, 64). Returns a
 * checksum (so that the loop is kept). Twelve running sums, not eight: a vpdpbusd's result is
 * ready about 5 cycles after it starts and two can start per cycle, so eight chains left the
 * units waiting (Intel Xeon family 6 model 207: 428-497 GMAC/s on 2 threads with eight, 694 with
 * twelve in a separate C loop). */
#if DD_WIDE_A8
#define PEAK_STEP_KIND 2
#define PEAK_VEC __m512i
#define PEAK_SET1(v) _mm512_set1_epi8(v)
#define PEAK_ACC(S, A, B) _mm512_dpbusd_epi32(S, A, B)
#define PEAK_ADD(a, b) _mm512_add_epi32(a, b)
#define PEAK_FIRST(t) _mm_cvtsi128_si32(_mm512_castsi512_si128(t))
#else
#if defined(__AVXVNNI__)
#define PEAK_STEP_KIND 1
#define PEAK_ACC(S, A, B) _mm256_dpbusd_avx_epi32(S, A, B)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PEAK_STEP_KIND 1
#define PEAK_ACC(S, A, B) _mm256_dpbusd_epi32(S, A, B)
#else
#define PEAK_STEP_KIND 0
#define PEAK_ACC(S, A, B) _mm256_add_epi16(S, _mm256_maddubs_epi16(A, B))
#endif
#define PEAK_VEC __m256i
#define PEAK_SET1(v) _mm256_set1_epi8(v)
#define PEAK_ADD(a, b) _mm256_add_epi16(a, b)
#define PEAK_FIRST(t) _mm256_extract_epi16(t, 0)
#endif
int dd_int8_peak_step(void) {
    return PEAK_STEP_KIND;
}

int64_t dd_int8_peak(int64_t iters, int nthreads) {
    int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        PEAK_VEC a0 = PEAK_SET1(1), a1 = PEAK_SET1(2), a2 = PEAK_SET1(3), a3 = PEAK_SET1(4);
        const PEAK_VEC b = PEAK_SET1(1);
        PEAK_VEC s0 = PEAK_SET1(0), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0, s8 = s0, s9 = s0,
                 s10 = s0, s11 = s0;
#define PEAK_STEP(S, A) /* a new operand for every product (nothing to share or hoist), a running sum */ \
        __asm__("" : "+v"(A));                                                                  \
        S = PEAK_ACC(S, A, b);                                                                   \
        __asm__("" : "+v"(S));
        for (int64_t it = 0; it < iters; it++) {
            PEAK_STEP(s0, a0) PEAK_STEP(s1, a1) PEAK_STEP(s2, a2) PEAK_STEP(s3, a3)
            PEAK_STEP(s4, a0) PEAK_STEP(s5, a1) PEAK_STEP(s6, a2) PEAK_STEP(s7, a3)
            PEAK_STEP(s8, a0) PEAK_STEP(s9, a1) PEAK_STEP(s10, a2) PEAK_STEP(s11, a3)
        }
#undef PEAK_STEP
        const PEAK_VEC t = PEAK_ADD(PEAK_ADD(PEAK_ADD(PEAK_ADD(s0, s1), PEAK_ADD(s2, s3)), PEAK_ADD(PEAK_ADD(s4, s5), PEAK_ADD(s6, s7))),
                                    PEAK_ADD(PEAK_ADD(s8, s9), PEAK_ADD(s10, s11)));
        total += PEAK_FIRST(t);
    }
    return total;
}

/* The sum of the 32-bit words of p [bytes] (a multiple of 128; each lane's sum wraps at 32 bits),
 * read by `nthreads` threads, each its contiguous share on 256-bit loads: what the benchmark times
 * to get the rate of re-reading weights (native.read_rate). */
int64_t dd_read_sum(const uint8_t *p, int64_t bytes, int nthreads) {
    int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        const int64_t th = omp_get_num_threads(), t = omp_get_thread_num(), blocks = bytes / 128;
        const int64_t lo = blocks * t / th * 128, hi = blocks * (t + 1) / th * 128;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = lo; i < hi; i += 128) {
            s0 = _mm256_add_epi32(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
            s1 = _mm256_add_epi32(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
            s2 = _mm256_add_epi32(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
            s3 = _mm256_add_epi32(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
        }
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, s);
        for (int l = 0; l < 8; l++) total += lanes[l];
    }
    return total;
}

/* The k largest values of a row of a and b (one row of each: [a | b]) into top[0..k) (descending; of
 * equal values the earlier column first) with their columns (b's numbered from na). One pass: 8
 * lanes at a time against the k-th value so far, a lane that beats it inserted in order. */
static void top_row(const float *a, int64_t na, const float *b, int64_t nb, int64_t k, float *top, int64_t *col) {
    int64_t have = 0;
    for (int part = 0; part < 2; part++) {
        const float *x = part ? b : a;
        const int64_t n = part ? nb : na, base = part ? na : 0;
        int64_t i = 0;
        while (i < n) {
            if (have == k && i + 8 <= n) {
                const __m256 v = _mm256_loadu_ps(x + i);
                if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(top[k - 1]), _CMP_GT_OQ))) {
                    i += 8;
                    continue;
                }
            }
            const int64_t end = have == k && i + 8 <= n ? i + 8 : i + 1;
            for (; i < end; i++) {
                const float v = x[i];
                if (have == k && !(v > top[k - 1])) continue;
                int64_t j = have < k ? have++ : k - 1;
                for (; j > 0 && v > top[j - 1]; j--) {
                    top[j] = top[j - 1];
                    col[j] = col[j - 1];
                }
                top[j] = v;
                col[j] = base + i;
            }
        }
    }
}

/* The draft's scores at one level: for each of n rows of logits [a | b] (a: [n, na], b: [n, nb] or
 * nb = 0), the k best of log_softmax(scale * row), descending, into values [n, k], and their
 * columns into ids [n, k] (b's numbered from na): what torch's cat, multiply, log_softmax and topk
 * give (about 0.1 ms at one row of 8,448 here), in two passes over the row and no copy of it.
 * log_softmax as torch takes it: (s - max) - log(sum e^(s - max)), s = scale * logit (scale > 0, so
 * the largest s is scale * the largest logit); the sum's order is this function's, so the last bit
 * can differ from torch's. Returns 1 for bad sizes. */
int dd_top_logprobs(const float *a, int64_t na, const float *b, int64_t nb, int64_t n, float scale, int64_t k,
                    float *values, int64_t *ids) {
    if (n < 0 || k < 1 || na < 0 || nb < 0 || k > na + nb || !(scale > 0.0f)) return 1;
    for (int64_t r = 0; r < n; r++) {
        const float *x = a + r * na, *y = nb ? b + r * nb : NULL;
        float *top = values + r * k;
        int64_t *col = ids + r * k;
        top_row(x, na, y, nb, k, top, col);
        const float mx = scale * top[0];
        const __m256 s8 = _mm256_set1_ps(scale), m8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        float sum = 0.0f;
        for (int part = 0; part < 2; part++) {
            const float *z = part ? y : x;
            const int64_t m = part ? nb : na;
            int64_t i = 0;
            for (; i + 8 <= m; i += 8)
                sum8 = _mm256_add_ps(sum8, exp8(_mm256_fmsub_ps(_mm256_loadu_ps(z + i), s8, m8)));
            for (; i < m; i++) sum += exp1(scale * z[i] - mx);
        }
        const float lse = logf(hsum8(sum8) + sum);
        for (int64_t j = 0; j < k; j++) top[j] = (scale * top[j] - mx) - lse;
    }
    return 0;
}
