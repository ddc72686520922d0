/* ddspec's CPU kernels: small-row matmuls on GGUF-quantised or dense weights, and whole Llama
 * decoder layers in a single call.
 *
 * Why: on a 2-core CPU a target forward over 1-16 tokens is dominated by two things torch
 * cannot fix from Python: reading 4-byte weights that the model ships as 4.5-bit GGUF blocks,
 * and ~40 small ops per layer, each paying dispatch and thread wake-up. Here a forward's layers
 * are one call and one OpenMP region, their phases separated by a barrier of our own (dd_sync).
 * A Q4_1 / Q8_0 weight is read in its GGUF blocks: per block of 32 inputs the kernel sums x*q over the integer levels and applies the
 * block's scale and minimum once (d * sum(x*q) + m * sum(x)), which is the product with the
 * dequantised weights (gguf-py's w = d*q + m) rearranged: it agrees with the fp32 model's
 * matmul to about an ulp per block, and a one-hot row still reads back gguf-py's exact fp32
 * weight. Dense weights (fp32, or fp16 / bf16 holding fp32 values exactly) are multiplied
 * weight by weight.
 *
 * Every matmul output is computed by one thread, in an order that depends neither on the
 * number of rows in the call nor on the thread count: row r of a 16-row matmul equals the
 * same row computed alone, bit for bit. The attention sums a row's visible keys in the same
 * lanes whatever the keys it does not see (softmax_row), so a tree node's whole forward equals,
 * bit for bit, its token decoded alone after its ancestors.
 *
 * Built on first use by ddspec/native/__init__.py (cc -O3 -mavx2 -mfma -mf16c -fopenmp
 * -ffp-contract=off, plus -mavxvnni / -mavx512f, and -mgfni / -mavx512vbmi for the 16-lane
 * passes' unpacking, where the CPU has them: see DD_VNNI, DD_WIDE, levels16 and a8_levels16, which
 * change the instructions, never the results) and called through ctypes; nothing here
 * allocates memory the caller sees.
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sched.h>

enum { DD_F32 = 0, DD_Q4_1 = 1, DD_Q8_0 = 2, DD_F16 = 3, DD_BF16 = 4, DD_Q4_1_A8 = 5, DD_Q8_0_A8 = 6 };

/* A weight W [out, in] packed in groups of 16 outputs (G = ceil(out / 16) groups; padding
 * outputs hold zeros), so that one 8-lane vector holds 8 outputs' weights at one input k:
 *   DD_F32:  w  [G, in, 16] floats
 *   DD_F16, DD_BF16: w [G, in, 16] halves / bfloat16s (used only when they hold the fp32
 *            weights exactly, e.g. a head shipped in fp16: half the bytes, the same values)
 *   DD_Q4_1: qs [G, in/32, 320] bytes: for each group and block of 32 inputs, the 16 outputs'
 *            scales d and minimums m (fp16, as in the GGUF file; widened to fp32 exactly where
 *            they are used), then 32 x 8 bytes of levels, byte j of input k =
 *            q(output j) | q(output j + 8) << 4: one stream of memory per group
 *   DD_Q8_0: qs [G, in/32, 544] bytes: 16 scales d (fp16), then 32 x 16 int8 levels
 *   DD_Q4_1_A8, DD_Q8_0_A8: the same blocks with the levels in another order, multiplied with
 *            activations rounded to 8 bits (integer sums; see DD_Q4_1_A8 and DD_Q8_0_A8 below)
 * The kernel broadcasts x[r, k] and accumulates one FMA per k into each output's lane, in
 * order of k (per block for the quantised kinds, see levels_at): the sum an output gets depends neither on how many rows nor on how many
 * outputs share a pass (nor on the threads), so a row's result is the same bit for bit
 * whether it is computed alone or inside a tree. */
typedef struct {
    int64_t kind, out, in;
    const float *w;
    const uint8_t *qs;
    const float *d, *m;
    const float *bias;   /* [out] or NULL */
} dd_weight;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    const float *in_norm;   /* [hidden] or NULL (EAGLE heads have no first norm) */
    const float *post_norm; /* [hidden] */
    dd_weight qkv, o, gate_up, down;
    int64_t extra; /* > 0: q/k/v read cat(extra[i], in_norm(x[i])), extra given per call [n, extra]
                    * (an EAGLE-3 midlayer: the normed embedding beside the normed hidden state) */
} dd_layer;

#define TILE 6 /* rows per pass: 6 rows x 2 vectors = 12 accumulators of the 16 ymm registers */
#ifndef BUFFER_FROM
#define BUFFER_FROM 6 /* more rows than this: each block of weights is read (and rebuilt) once, into L1 */
#endif

/* The build compiles this file in parts, in parallel, and links them (as a single -O3 unit it
 * takes about 20 s of one core). Part p: 1-5 the matmuls of one weight kind each (Q4_1, Q8_0,
 * fp32, fp16, bf16), 6 the rest (layers, attention, the entry points); -DDD_PARTS=mask compiles
 * the parts whose bit (1 << p) is set. Without DD_PARTS it is one unit. */
#ifndef DD_PARTS
#define DD_PARTS 0
#endif
#define DD_HAS(p) (DD_PARTS == 0 || (DD_PARTS >> (p)) & 1)
#if DD_PARTS
#define DD_SHARED __attribute__((visibility("hidden")))
#else
#define DD_SHARED static
#endif
#define DD_HIDDEN __attribute__((visibility("hidden")))
DD_SHARED void qgemm_shared_q4_1(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void qgemm_shared_q8_0(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void a8gemm_shared_q4_1(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void a8gemm_shared_q8_0(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void dense_gemm_shared_f32(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void dense_gemm_shared_f16(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_SHARED void dense_gemm_shared_bf16(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The largest of 8 lanes (none of them NaN): max is exact, so any order gives the same value. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* This thread's output groups [*g0, *g1) of `groups`: contiguous ranges balanced to within one
 * group among the team's threads (all of them outside a parallel region). A matmul's threads
 * split groups, not passes of G groups: 36 groups in passes of 4 are 9 passes, 5 for one thread
 * and 4 for the other, where 18 groups each are even. The caller ends with a barrier. */
static inline void thread_groups(int64_t groups, int64_t *g0, int64_t *g1) {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    *g0 = groups * t / T;
    *g1 = groups * (t + 1) / T;
}

/* Work stealing between a matmul's threads. On a shared machine one core can run slower than
 * the other for a while (a neighbour on its sibling hyperthread): with groups split statically
 * the faster thread then waits at the barrier. Each thread starts with thread_groups' share of a
 * matmul's units (G groups on the AVX-512 passes; a group, a pair or a triple of groups on the
 * 8-lane ones) and takes G of them at a time from its front; once its share is done it takes G at
 * a time from the end of another thread's. Which thread computes a group never changes a result (every
 * output is one thread's sum in a fixed order), so the bits are the same. A span packs a range
 * [front, end) of groups, front in the low 32 bits, and is changed by compare-and-swap only; the
 * spans belong to the enclosing parallel region (dd_spans, set by each of its threads; NULL:
 * split statically). A matmul ends with a barrier, after which every span is empty, so a thread
 * that looks at another's span before that thread has set it for the next matmul finds nothing
 * to take. */
typedef struct {
    _Alignas(64) uint64_t w;
} dd_span;
#define DD_MAX_SPANS 64
extern DD_HIDDEN __thread dd_span *dd_spans;
extern DD_HIDDEN int dd_span_delay_us;    /* tests: thread 0 starts this late, after setting its span */
extern DD_HIDDEN int64_t dd_groups_taken; /* groups taken from another thread's span, in all (tests) */

static inline void span_start(int64_t groups) {
    if (!dd_spans) return;
    int64_t g0, g1;
    thread_groups(groups, &g0, &g1);
    __atomic_store_n(&dd_spans[omp_get_thread_num()].w, (uint64_t)g1 << 32 | (uint64_t)g0, __ATOMIC_RELEASE);
    if (dd_span_delay_us > 0 && omp_get_thread_num() == 0)
        for (const double until = omp_get_wtime() + 1e-6 * dd_span_delay_us; omp_get_wtime() < until;)
            ;
}

/* The next units [*g, *g + return) for this thread, at most G of them; 0 when none is left. Without
 * spans, `*g` walks this thread's static range (the caller sets it to -1 first). */
static inline int64_t span_next(int64_t groups, int64_t G, int64_t *g) {
    if (!dd_spans) {
        int64_t g0, g1;
        thread_groups(groups, &g0, &g1);
        *g = *g < 0 ? g0 : *g + G;
        return *g < g1 ? (g1 - *g < G ? g1 - *g : G) : 0;
    }
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    dd_span *own = dd_spans + t;
    uint64_t w = __atomic_load_n(&own->w, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t front = w & 0xffffffffu, end = w >> 32;
        if (front >= end) break;
        const uint64_t next = front + G < end ? front + G : end;
        if (__atomic_compare_exchange_n(&own->w, &w, end << 32 | next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *g = (int64_t)front;
            return (int64_t)(next - front);
        }
    }
    for (int k = 1; k < T; k++) {
        dd_span *other = dd_spans + (t + k) % T;
        uint64_t v = __atomic_load_n(&other->w, __ATOMIC_ACQUIRE);
        for (;;) {
            const uint64_t front = v & 0xffffffffu, end = v >> 32;
            if (front >= end) break;
            const uint64_t from = end - front > (uint64_t)G ? end - G : front;
            if (__atomic_compare_exchange_n(&other->w, &v, from << 32 | front, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                if (dd_span_delay_us > 0) __atomic_add_fetch(&dd_groups_taken, (int64_t)(end - from), __ATOMIC_RELAXED);
                *g = (int64_t)from;
                return (int64_t)(end - from);
            }
        }
    }
    return 0;
}

/* The barrier between the phases of a parallel region. OpenMP's (an explicit barrier or the end of
 * a worksharing loop) took 0.53-0.57 us per crossing on 2 threads of an Intel Xeon (a C loop of
 * 100,000), a counter and a generation word 0.09-0.10 us; a layer crosses about 11 of them. The
 * regions that set dd_bars (dd_layers_forward, dd_gemm: the counter lives on the stack of the
 * thread that opens the region, like the spans) cross this one; elsewhere (dd_bars NULL) OpenMP's.
 * Each arriving thread adds one to count (acquire-release, so the last one to arrive has seen
 * every thread's writes before the barrier); the last resets it and publishes a new generation
 * (release), for which the others wait (acquire). A waiting thread spins, and after DD_SPINS
 * rounds yields its core. With more threads than the CPUs this process may run on, a spinning
 * thread would hold a CPU that the thread it waits for needs (4 threads on 2 CPUs: forwards 3-5x
 * slower than with OpenMP's barrier, which then sleeps sooner), so a region uses this barrier only
 * with as many threads as CPUs (dd_bar_fits). Every thread of the region must cross the same
 * barriers, as with OpenMP's. */
typedef struct {
    _Alignas(64) uint32_t count;
    _Alignas(64) uint32_t gen;
    void *slot[3]; /* pointers one thread hands the others across a barrier (a8_gemm's shared rows) */
} dd_bar;
#define DD_SPINS 4096
extern DD_HIDDEN __thread dd_bar *dd_bars;

/* Whether a region of `threads` threads may use dd_sync's barrier: no more of them than the CPUs
 * the calling thread may run on (counted once). Decided by the thread that opens the region, before
 * it does, so that every thread of the region crosses the same kind of barrier. */
static inline int dd_bar_fits(int threads) {
    static int cpus = 0;
    int c = __atomic_load_n(&cpus, __ATOMIC_RELAXED);
    if (c == 0) {
        cpu_set_t set;
        c = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
        c = c > 0 ? c : 1;
        __atomic_store_n(&cpus, c, __ATOMIC_RELAXED);
    }
    return threads <= c;
}

/* A region's threads find its spans and barrier through dd_spans / dd_bars: each sets them as the
 * region starts (bar NULL: OpenMP's barrier, see dd_bar_fits) and clears them as it ends. */
static inline void team_enter(dd_span *spans, dd_bar *bar) {
    dd_spans = omp_get_num_threads() <= DD_MAX_SPANS ? spans : NULL;
    dd_bars = bar;
}

static inline void team_leave(void) {
    dd_spans = NULL;
    dd_bars = NULL;
}

static inline void dd_sync(void) {
    dd_bar *b = dd_bars;
    if (!b) {
#pragma omp barrier
        return;
    }
    const uint32_t threads = (uint32_t)omp_get_num_threads();
    const uint32_t gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) == gen; spins++) {
        if (spins < DD_SPINS) _mm_pause();
        else sched_yield();
    }
}

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

/* Quantised weights (Q4_1, Q8_0) are multiplied block by block. For each GGUF block b of 32
 * inputs and each output: s = sum over the block of x[k] * q[k] (the integer levels, exact as
 * floats; one FMA per k, in order, from zero), then y = fma(d, s, y) and, for Q4_1,
 * y = fma(m, sx[b], y), sx[b] being the block's sum of x (summed in order, the same in every
 * call). That is the dequantised weight's product (w = d*q + m) rearranged: about half the
 * instructions per weight of rebuilding each w, rounding that differs from the fp32 matmul by
 * about an ulp per block, and still arithmetic per output that depends neither on the other
 * rows nor on the threads. A one-hot row reads back gguf-py's fl(fl(d*q) + m) / fl(q*d) exactly. */
#define BLOCK_BYTES(KIND) ((KIND) == DD_Q4_1 ? 320 : 544) /* one group's block of 32 inputs, see dd_weight */
/* GF2P8AFFINEQB matrices (GFNI builds) taking a byte's low nibble, and its high nibble shifted
 * down: bit i of a result byte = bit k of the source byte where matrix byte 7 - i = 1 << k */
#define NIBBLE_LOW 0x0102040800000000LL
#define NIBBLE_HIGH 0x1020408000000000LL

/* A block's 16 scales (at its start) or minimums (32 bytes on, Q4_1): fp16, as in the GGUF file,
 * which holds every one of them exactly, so the fp32 values the kernels compute with are the same
 * as when the blocks stored them in fp32 (384 / 576 bytes a block until 2026-12-05): the same bits
 * with a sixth (Q4_1) or an eighteenth (Q8_0) fewer bytes to stream per token. half8: outputs
 * 0-7 of them (p = the block, or + 16 for outputs 8-15); half16: all 16. */
static inline __attribute__((always_inline)) __m256 half8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 half16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#endif

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

/* sx[r * nb + b] = x[r, 32b] + ... + x[r, 32b + 31], in order. */
static void block_sums(const float *x, int64_t n, int64_t in, float *sx) {
    const int64_t nb = in / 32;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += x[r * in + b * 32 + k];
            sx[r * nb + b] = s;
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

/* Group g's 16 sums v (the padding outputs past W->out dropped), plus the bias, into y (+)=. */
static inline void store_outputs(const dd_weight *W, int64_t g, const float *v, float *y, int accumulate) {
    const int64_t o0 = g * 16, n = W->out - o0 < 16 ? W->out - o0 : 16;
    for (int64_t j = 0; j < n; j++) {
        const float s = v[j] + (W->bias ? W->bias[o0 + j] : 0.0f);
        if (accumulate) y[o0 + j] += s; else y[o0 + j] = s;
    }
}

static inline void store_group(const dd_weight *W, int64_t g, __m256 a0, __m256 a1, float *y, int accumulate) {
    float v[16];
    _mm256_storeu_ps(v, a0);
    _mm256_storeu_ps(v + 8, a1);
    store_outputs(W, g, v, y, accumulate);
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
#if DD_HAS(3) || DD_HAS(4) || DD_HAS(5)
BUF_TILE(1) BUF_TILE(2) BUF_TILE(3) BUF_TILE(4) BUF_TILE(5) BUF_TILE(6)
#endif

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

/* Blocks ahead (0: none) that the quantised passes of PREFETCH_ROWS rows or more ask the L2 cache
 * to fetch, besides the hardware's own prefetching: with several rows a pass spends long enough on
 * each block that the hardware's streams fall behind. Measured on the AMD EPYC family 26 machine
 * (the int8 target's forward after 256 tokens, interleaved medians of 41): 24 blocks ahead made
 * 4 / 8 / 16 tokens 0.92x / 0.85x / 0.87x as long (fp32 activations: 0.90x / 0.81x / 0.79x), 1-2
 * rows no faster (1-4% slower); with the AVX-512 passes switched off (the 8-lane passes, as on
 * an AVX2-only CPU) 0.96-0.98x / 0.83-0.85x / 0.84-0.89x (fp32 0.96-0.99x / 0.85-0.89x /
 * 0.93-0.96x; two runs). Python sets it from a
 * measurement on the machine at hand (native.choose_wide); the same bits whatever it is. */
extern DD_HIDDEN int dd_prefetch_blocks;
extern DD_HIDDEN int dd_share_rows; /* see a8_gemm and dd_set_share_rows */
#define PREFETCH_ROWS 3
#define PREFETCH_AHEAD(R, blk, bytes)                                                               \
    do {                                                                                            \
        if ((R) >= PREFETCH_ROWS && dd_prefetch_blocks)                                             \
            for (int l_ = 0; l_ < (bytes); l_ += 64)                                                \
                _mm_prefetch((const char *)(blk) + dd_prefetch_blocks * (bytes) + l_, _MM_HINT_T1); \
    } while (0)

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

/* AVX-512 (where the build enables it: native/__init__.py adds -mavx512f on CPUs that have it):
 * the quantised kinds with fp32 activations, one 16-lane register per group of 16 outputs.
 * Each lane runs exactly the arithmetic of the 8-lane passes above (the same FMAs, in the same
 * order of k, the same block ends), so the results are the same bits; what changes is the work
 * around them: one conversion of a group's levels and one broadcast of x per 16 products instead
 * of per 8, so several rows share the 8 bytes of levels at half the instructions. A pass runs
 * R rows against G consecutive groups (R * G independent FMA chains). dd_wide_groups says, per
 * kind and tile size, which G (0: the 8-lane passes); Python sets it from measurements on the
 * machine at hand (native/__init__.py, choose_wide), since the best G differs between CPUs. */
#if defined(__AVX512F__)
#define DD_WIDE 1
#else
#define DD_WIDE 0
#endif
#ifndef WIDE_TILE
#define WIDE_TILE 8 /* rows per pass: 8 rows x 2 groups = 16 chains, 2 level registers, 1 broadcast
                      * (tiles of 10 or 12 rows measured slower: gcc spills some of their 20-24 sums) */
#endif
/* AVX-512 VNNI (vpdpbusd on 16 lanes) for the kinds with 8-bit activations, where the build also
 * enables it (-mavx512vnni): see DD_Q4_1_A8's wide passes */
#if DD_WIDE && defined(__AVX512VNNI__)
#define DD_WIDE_A8 1
#else
#define DD_WIDE_A8 0
#endif
/* groups per pass by kind (0: Q4_1, 1: Q8_0, 2: Q4_1_A8, 3: Q8_0_A8) and rows in the largest tile
 * (1 .. WIDE_TILE); 0: the 8-lane passes */
extern DD_HIDDEN int8_t dd_wide_groups[4][WIDE_TILE];

static inline int wide_index(int64_t kind) {
    return kind == DD_Q4_1 ? 0 : kind == DD_Q8_0 ? 1 : kind == DD_Q4_1_A8 ? 2 : 3;
}

/* G for n rows of a kind (the entry of their largest tile), 0 for the 8-lane passes */
static inline int64_t wide_groups(int64_t kind, int64_t n) {
    const int64_t tiles = (n + WIDE_TILE - 1) / WIDE_TILE;
    return dd_wide_groups[wide_index(kind)][(n + tiles - 1) / tiles - 1];
}

#if DD_WIDE && (DD_HAS(1) || DD_HAS(2))
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

/* Quantised y (+)= x @ W^T inside a parallel region (see gemm_shared), one function per kind. */
#define QGEMM(KIND_ID, KIND)                                                                        \
WPASSES(KIND_ID, KIND)                                                                              \
DD_SHARED void qgemm_shared_##KIND(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) { \
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

#if DD_HAS(1)
QPASSES(DD_Q4_1, q4_1)
QGEMM(DD_Q4_1, q4_1)
#endif
#if DD_HAS(2)
QPASSES(DD_Q8_0, q8_0)
QGEMM(DD_Q8_0, q8_0)
#endif


#if DD_HAS(1) || DD_HAS(2)
/* VNNI, where the build enables it (native/__init__.py adds -mavxvnni, or -mavx512vnni -mavx512vl,
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

/* Rows [0, n) of x [n, in] -> qx [n, in] int8 and their scales dx [n, in / 32]; with sq, also
 * each block's integer sum of qx (the rounded values are within [-127, 127], so the packs below
 * never saturate and the sum of the 32-bit values is the sum of qx). */
static void quantise_rows_a8(const float *x, int64_t n, int64_t in, int8_t *qx, float *dx, int32_t *sq) {
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
            if (sq) {
                const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
                sq[r * nb + b] = _mm_cvtsi128_si32(h);
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

/* Rows [0, R) of the rounded activations against group g (R = 1 .. the kind's tile). */
typedef void (*a8_pass)(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, const float *sx,
                        float *y, int64_t ldy, int accumulate);
/* Rows [0, R) against groups [g, g + G) on 16 lanes (DD_WIDE_A8); sq: the rows' integer block sums of qx. */
typedef void (*a8_wide_pass)(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx, const float *sx,
                             const int32_t *sq, float *y, int64_t ldy, int accumulate);

/* a8_gemm's buffers: the rounded rows qx, their scales dx and block sums sx (one allocation), and
 * with with_sq the block sums of qx */
static void a8_alloc(int64_t n, int64_t in, int with_sq, int8_t **qx, float **dx, int32_t **sq) {
    const int64_t nb = in / 32;
    *qx = aligned_alloc(32, (size_t)((n * in + 31) / 32 * 32));
    *dx = malloc(sizeof(float) * (size_t)(2 * n * nb + 1));
    *sq = with_sq ? malloc(sizeof(int32_t) * (size_t)(n * nb + 1)) : NULL;
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
#if DD_WIDE_A8
    const int64_t G = wide ? wide_groups(W->kind, n) : 0;
    /* the 16-lane Q8_0 passes add 128 to the levels and take it back with the block sums of qx */
    const int with_sq = G && W->kind == DD_Q8_0_A8;
#else
    const int with_sq = 0;
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
            a8_alloc(n, in, with_sq, &qx, &dx, &sq);
            dd_bars->slot[0] = qx, dd_bars->slot[1] = dx, dd_bars->slot[2] = sq;
        }
        dd_sync();
        qx = dd_bars->slot[0], dx = dd_bars->slot[1], sq = dd_bars->slot[2];
    } else if (share) {
#pragma omp single copyprivate(qx, dx, sq)
        a8_alloc(n, in, with_sq, &qx, &dx, &sq);
    } else {
        a8_alloc(n, in, with_sq, &qx, &dx, &sq);
    }
    float *sx = dx + n * nb;
    if (share) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            quantise_rows_a8(x + r * in, 1, in, qx + r * in, dx + r * nb, sq ? sq + r * nb : NULL);
            if (W->kind == DD_Q4_1_A8) block_sums(x + r * in, 1, in, sx + r * nb);
        }
        dd_sync();
    } else {
        quantise_rows_a8(x, n, in, qx, dx, sq);
        if (W->kind == DD_Q4_1_A8) block_sums(x, n, in, sx);
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
            passes[rows - 1](W, g, qx + r * in, dx + r * nb, sx + r * nb, y + r * ldy, ldy, acc);
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

#endif

#if DD_HAS(1)
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
                          const float *sx, float *y, int64_t ldy, int accumulate) {                 \
        const int64_t nb = W->in / 32, in = W->in;                                                  \
        enum { BYTES = BLOCK_BYTES(DD_Q4_1) };                                                      \
        const __m256i low = _mm256_set1_epi8(0x0F);                                                 \
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
                const __m256i lo = _mm256_and_si256(L, low);                                        \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), low);                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256i xb = bcast4(qx + r * in + b * 32 + 4 * i);                        \
                    s0[r] = a8_acc(s0[r], lo, xb);                                                  \
                    s1[r] = a8_acc(s1[r], hi, xb);                                                  \
                    /* keep each sum a running sum: unrolled, gcc would otherwise keep all 16R   \
                     * products live and add them as a tree, spilling most of them */           \
                    __asm__("" : "+x"(s0[r]), "+x"(s1[r]));                                         \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                a8_block_end(blk, dx[r * nb + b], sx[r * nb + b], s0[r], s1[r], tot + r * 16);      \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
            store_group(W, g, _mm256_load_ps(tot + r * 16), _mm256_load_ps(tot + r * 16 + 8), y + r * ldy, accumulate); \
    }
APASS(1) APASS(2) APASS(3) APASS(4)
AWPASSES(DD_Q4_1_A8, q4_1a8)

DD_SHARED void a8gemm_shared_q4_1(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    static const a8_pass passes[4] = {apass_1, apass_2, apass_3, apass_4};
    a8_gemm(W, x, n, y, ldy, acc, passes, 4, A8_WIDE(q4_1a8));
}
#endif


#if DD_HAS(2)
/* DD_Q8_0_A8: a Q8_0 weight with 8-bit activations (the rounding of DD_Q4_1_A8). vpmaddubsw
 * needs one unsigned operand: it multiplies |q| by the activation carrying q's sign, and the
 * pair sums (at most 2 * 127 * 127 < 2^15) go to 32 bits at once. Layout per (group, block),
 * 544 bytes: 16 d (fp16), then per quad i of 4 inputs 32 bytes for outputs 0-7 (byte 4o + j =
 * q(o, 4i + j)) and 32 for outputs 8-15. */
#define QAPASS(R)                                                                                   \
    static void qapass_##R(const dd_weight *W, int64_t g, const int8_t *qx, const float *dx,       \
                           const float *sx, float *y, int64_t ldy, int accumulate) {                \
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

DD_SHARED void a8gemm_shared_q8_0(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    static const a8_pass passes[3] = {qapass_1, qapass_2, qapass_3};
    a8_gemm(W, x, n, y, ldy, acc, passes, 3, A8_WIDE(q8_0a8));
}
#endif

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

/* Dense y (+)= x @ W^T inside a parallel region (see gemm_shared), one function per kind. */
#define DGEMM(KIND)                                                                                 \
DD_SHARED void dense_gemm_shared_##KIND(const dd_weight *W, const float *x, int64_t n, float *y,   \
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

#if DD_HAS(3)
PASSES(DD_F32, f32)
DGEMM(f32)
#endif
#if DD_HAS(4)
PASSES(DD_F16, f16)
DGEMM(f16)
#endif
#if DD_HAS(5)
PASSES(DD_BF16, bf16)
DGEMM(bf16)
#endif

#if DD_HAS(6)
/* y [n, out] (+)= x [n, in] @ W^T; output groups are shared among the threads of the enclosing
 * parallel region (see dd_span; also correct when called outside one), which end with a barrier. */
static void gemm_shared(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    if (W->kind == DD_Q4_1) qgemm_shared_q4_1(W, x, n, y, ldy, acc);
    else if (W->kind == DD_Q4_1_A8) a8gemm_shared_q4_1(W, x, n, y, ldy, acc);
    else if (W->kind == DD_Q8_0_A8) a8gemm_shared_q8_0(W, x, n, y, ldy, acc);
    else if (W->kind == DD_Q8_0) qgemm_shared_q8_0(W, x, n, y, ldy, acc);
    else if (W->kind == DD_F16) dense_gemm_shared_f16(W, x, n, y, ldy, acc);
    else if (W->kind == DD_BF16) dense_gemm_shared_bf16(W, x, n, y, ldy, acc);
    else dense_gemm_shared_f32(W, x, n, y, ldy, acc);
}

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

DD_HIDDEN __thread dd_span *dd_spans;
DD_HIDDEN __thread dd_bar *dd_bars;
DD_HIDDEN int dd_span_delay_us = 0;
DD_HIDDEN int64_t dd_groups_taken = 0;

/* For tests: thread 0 of every quantised or dense matmul starts `us` microseconds late (0: not
 * at all), so that the other threads take its groups; returns the groups taken from another
 * thread's span while a delay was set, since the last call. */
int64_t dd_set_span_delay(int us) {
    dd_span_delay_us = us > 0 ? us : 0;
    return __atomic_exchange_n(&dd_groups_taken, 0, __ATOMIC_RELAXED);
}

/* The first column of each row's largest value in y[r*ld + c0 .. c1) (numpy's argmax: a NaN is
 * the largest, its first occurrence wins), as (*val, *idx). */
static void argmax_span(const float *y, int64_t c0, int64_t c1, float *val, int64_t *idx) {
    __m256 mx8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        const __m256 v = _mm256_loadu_ps(y + c);
        mx8 = _mm256_max_ps(mx8, v);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float mx = hmax8(mx8);
    int nan = _mm256_movemask_ps(nan8) != 0;
    for (; c < c1; c++) {
        if (y[c] != y[c]) nan = 1;
        else if (y[c] > mx) mx = y[c];
    }
    for (c = c0; c < c1; c++)
        if (nan ? y[c] != y[c] : y[c] == mx) break;
    *val = c < c1 ? y[c] : -INFINITY;
    *idx = c < c1 ? c : -1;
}

/* Whether the matmul entries refuse W: a block weight whose inputs are not whole blocks of 32. */
static int partial_blocks(const dd_weight *W) {
    return (W->kind == DD_Q4_1 || W->kind == DD_Q8_0 || W->kind == DD_Q4_1_A8 || W->kind == DD_Q8_0_A8) && W->in % 32;
}

/* y [n, out] = x [n, in] W^T on nthreads threads; with best (else NULL), also each row's argmax
 * (numpy's: the first largest, a NaN first of all) into best[n]: each thread scans half of the
 * columns after the matmul, in the same parallel region, while what it wrote is still in its own
 * caches (its first span of outputs is that half; read after the matmul from one thread, the
 * logits of one token took 0.1 ms, a tenth of that warm). Returns 1 for a block weight whose inputs
 * are not whole blocks, 2 when memory runs out. */
int dd_gemm(const dd_weight *W, const float *x, int64_t n, float *y, int nthreads, int64_t *best) {
    if (partial_blocks(W)) return 1;
    if (nthreads < 1) nthreads = 1;
    float *part_val = best ? malloc((size_t)(n * nthreads) * sizeof(float)) : NULL;
    int64_t *part_idx = best ? malloc((size_t)(n * nthreads) * sizeof(int64_t)) : NULL;
    if (best && (!part_val || !part_idx)) {
        free(part_val);
        free(part_idx);
        return 2;
    }
    dd_span spans[DD_MAX_SPANS] = {{0}};
    dd_bar bar = {0}, *team_bar = dd_bar_fits(nthreads) ? &bar : NULL;
    int used = 1;
#pragma omp parallel num_threads(nthreads)
    {
        team_enter(spans, team_bar);
        gemm_shared(W, x, n, y, W->out, 0);
        if (best) {
            dd_sync();
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t c0 = W->out * t / nt, c1 = W->out * (t + 1) / nt;
            for (int64_t r = 0; r < n; r++)
                argmax_span(y + r * W->out, c0, c1, part_val + r * nthreads + t, part_idx + r * nthreads + t);
            if (t == 0) used = nt;
        }
        team_leave();
    }
    for (int64_t r = 0; best && r < n; r++) {
        int64_t pick = -1;
        float v = -INFINITY;
        for (int t = 0; t < used; t++) {  /* halves in column order: a tie keeps the earlier */
            const float pv = part_val[r * nthreads + t];
            const int64_t pi = part_idx[r * nthreads + t];
            if (pi < 0) continue;
            if (pv != pv) { pick = pi; break; }
            if (pick < 0 || pv > v) { pick = pi; v = pv; }
        }
        best[r] = pick;
    }
    free(part_val);
    free(part_idx);
    return 0;
}

/* y = x @ W[i]^T for i = 0 .. count - 1 in turn (each over the same n rows, into the same y), in one
 * parallel region: the matmuls alone, as a forward's layers run them but with nothing between them
 * and no call per matmul. The same weight `count` times stays in the caches (its arithmetic
 * alone); `count` different ones stream from memory as in a forward (python -m ddspec.bench.phases
 * compares the two). y holds n x the widest output. Returns 0, or 1 for a quantised weight whose
 * input width is not a multiple of 32. */
int dd_gemm_sweep(const dd_weight *const *W, int64_t count, const float *x, int64_t n, float *y, int nthreads) {
    for (int64_t i = 0; i < count; i++)
        if (partial_blocks(W[i])) return 1;
    if (nthreads < 1) nthreads = 1;
    dd_span spans[DD_MAX_SPANS] = {{0}};
    dd_bar bar = {0}, *team_bar = dd_bar_fits(nthreads) ? &bar : NULL;
#pragma omp parallel num_threads(nthreads)
    {
        team_enter(spans, team_bar);
        for (int64_t i = 0; i < count; i++) gemm_shared(W[i], x, n, y, W[i]->out, 0);
        team_leave();
    }
    return 0;
}

/* e^x (Cephes' single-precision polynomial, ~1 ulp on [-87, 88]; e^-inf = 0) on 8 lanes (exp8)
 * or 16 (exp16): one sequence of operations, P the intrinsics' prefix, so every lane computes the
 * same value whichever width runs it. EXP_REDUCE clamps x and takes fx = x log2(e) + 1/2 (floored
 * by the caller); EXP_SCALE leaves y = e^(x - fx ln 2) * 2^fx, CAST turning the exponent's integer
 * lanes into floats. */
#define EXP_REDUCE(P, x, fx)                                                                        \
    x = P##min_ps(P##max_ps(x, P##set1_ps(-88.3762626647949f)), P##set1_ps(88.3762626647949f));  \
    fx = P##fmadd_ps(x, P##set1_ps(1.44269504088896341f), P##set1_ps(0.5f))
#define EXP_SCALE(P, CAST, x, fx, y)                                                                \
    x = P##fnmadd_ps(fx, P##set1_ps(0.693359375f), x);                                              \
    x = P##fnmadd_ps(fx, P##set1_ps(-2.12194440e-4f), x);                                           \
    y = P##set1_ps(1.9875691500E-4f);                                                               \
    y = P##fmadd_ps(y, x, P##set1_ps(1.3981999507E-3f));                                            \
    y = P##fmadd_ps(y, x, P##set1_ps(8.3334519073E-3f));                                            \
    y = P##fmadd_ps(y, x, P##set1_ps(4.1665795894E-2f));                                            \
    y = P##fmadd_ps(y, x, P##set1_ps(1.6666665459E-1f));                                            \
    y = P##fmadd_ps(y, x, P##set1_ps(5.0000001201E-1f));                                            \
    y = P##add_ps(P##fmadd_ps(y, P##mul_ps(x, x), x), P##set1_ps(1.0f));                             \
    y = P##mul_ps(y, CAST(P##slli_epi32(P##add_epi32(P##cvttps_epi32(fx), P##set1_epi32(127)), 23)))

static inline __m256 exp8(__m256 x) {
    const __m256 neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    __m256 fx, y;
    EXP_REDUCE(_mm256_, x, fx);
    fx = _mm256_floor_ps(fx);
    EXP_SCALE(_mm256_, _mm256_castsi256_ps, x, fx, y);
    return _mm256_andnot_ps(neg_inf, y);
}

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    const __mmask16 neg_inf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    __m512 fx, y;
    EXP_REDUCE(_mm512_, x, fx);
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    EXP_SCALE(_mm512_, _mm512_castsi512_ps, x, fx, y);
    return _mm512_maskz_mov_ps((__mmask16)~neg_inf, y);
}
#endif

static inline float exp1(float x) {
    return _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(x))));
}

/* out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i], one row. The sum of squares stays one scalar
 * chain in order of i: four 8-lane chains measured 0.97-0.99x the forward's time over 2-8 tokens
 * (int8, Intel Xeon family 6 model 207), but another order is another model, whose greedy
 * answers diverge from these within a few dozen tokens (58 of 60 benchmark answers, 2026-12-05),
 * and the shipped n-gram table holds exactly this model's answers. */
static void rms_norm_row(const float *x, const float *w, int64_t h, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < h; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = (x[i] * inv) * w[i];
}

/* x <- x*cos + rotate_half(x)*sin over one head vector of D values (torch's formula, unfused). */
static void rope(float *x, const float *cos_p, const float *sin_p, int64_t dim) {
    const int64_t half = dim / 2;
    float tmp[512];
    memcpy(tmp, x, (size_t)dim * sizeof(float));
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos_p[i] + (-tmp[i + half]) * sin_p[i];
    for (int64_t i = half; i < dim; i++) x[i] = tmp[i] * cos_p[i] + tmp[i - half] * sin_p[i];
}

/* srow[0..T) <- e^(srow - max) (masked entries, mrow[t] == 0, give 0); returns 1 / their sum.
 * With a mask the visible entries are first moved together, in order, and moved back after:
 * the sum then runs over the same vector lanes as for a row that sees only those keys, so a
 * tree's row gets bit for bit what the same token gets decoded alone after its ancestors (the
 * values pass adds p = 0 for the hidden keys, which changes no sum). */
static float softmax_dense(float *srow, int64_t T);
static float softmax_row(float *srow, int64_t T, const uint8_t *mrow) {
    const uint8_t *hidden = mrow ? memchr(mrow, 0, (size_t)T) : NULL;
    if (!hidden) return softmax_dense(srow, T);
    /* the keys before the first hidden one (a tree's whole prefix) are in place already */
    const int64_t first = hidden - mrow;
    int64_t v = first;
    for (int64_t t = first; t < T; t++)
        if (mrow[t]) srow[v++] = srow[t];
    const float inv = softmax_dense(srow, v);
    for (int64_t t = T - 1; t >= first; t--) srow[t] = mrow[t] ? srow[--v] : 0.0f;
    return inv;
}

static float softmax_dense(float *srow, int64_t T) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx8 = ninf;
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(srow + t));
    float mx = hmax8(mx8);
    for (; t < T; t++) mx = srow[t] > mx ? srow[t] : mx;
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    t = 0;
#if defined(__AVX512F__)
    /* 16 at a time, each half added to the 8 lanes' sums in turn: the 8-lane loop's order */
    for (const __m512 m16 = _mm512_set1_ps(mx); t + 16 <= T; t += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + t), m16));
        _mm512_storeu_ps(srow + t, p);
        sum8 = _mm256_add_ps(_mm256_add_ps(sum8, _mm512_castps512_ps256(p)), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
    }
#endif
    for (; t + 8 <= T; t += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + t), m8));
        _mm256_storeu_ps(srow + t, p);
        sum8 = _mm256_add_ps(sum8, p);
    }
    float sum = hsum8(sum8);
    for (; t < T; t++) {
        srow[t] = exp1(srow[t] - mx);
        sum += srow[t];
    }
    return 1.0f / sum;
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

#define KEY_CHUNK 64 /* keys per unit of work in the scores pass */
#define QTILE 6      /* queries per pass over the values: 6 x 2 accumulators */
#if defined(__AVX512F__)
#define ZKEY_CHUNK 32 /* keys per unit of work in the 16-lane scores pass */
#define ZSCORES_FROM 12 /* queries per kv head from which the scores run on 16 lanes (fewer: 0.99-1.01x) */
#define ZROWS 6 /* query rows per pass: 6 rows x 2 vectors of 16 keys = 12 independent chains */
#define ZQTILE 12 /* queries per pass over the values on 16 lanes: 12 x 2 accumulators */
#endif

/* Whether attention_shared's passes run on 16 lanes where the build has them (1) or on 8 (0): the
 * same bits either way; Python sets it from a measurement on the machine at hand
 * (NativeLlama._choose_attention), since their speed was timed on one CPU (AMD Zen 5) only. */
static int attention_wide = 1;
/* zeros after a causal row's last score: a values pass covers at most ZQTILE (12) queries, so its
 * last token is at most 11 past any of its rows' */
#define CAUSAL_FILL 16

/* The attention passes (ddspec_attention.inc, which undefines these parameters at its end) for a
 * cache of fp32 keys and values ... */
#define KVT float
#define KVN(name) name##_f32
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_ONE(p) (*(p))
#define KV_HALF 0
#include "ddspec_attention.inc"
/* ... and of fp16 ones (kv_half in dd_layers_forward: the 8-bit-activation model's cache) */
#define KVT uint16_t
#define KVN(name) name##_f16
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_ONE(p) _cvtsh_ss(*(p))
#define KV_HALF 1
#include "ddspec_attention.inc"

/* Which attention runs: 0 = by size (see layer_forward_buf), 1 = attention_rows, 2 = attention_shared. */
static int attention_mode = 0;

/* until Python sets the measured choice (native.choose_wide): a first sweep on AMD EPYC family 26
 * (the default model's layers and lm_head, interleaved medians) found Q4_1 best with three groups
 * up to 4 rows, then two, and Q8_0 (the lm_head: 49,152 outputs, one stream of memory per group)
 * with one group up to 5 rows, then two; the differences between G were within 10% */
#if DD_WIDE
DD_HIDDEN int8_t dd_wide_groups[4][WIDE_TILE] = {{3, 3, 3, 3, 2, 2, 2, 2}, {1, 1, 1, 1, 1, 2, 2, 2},
                                                 {DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8},
                                                 {DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8, DD_WIDE_A8}};
#else
DD_HIDDEN int8_t dd_wide_groups[4][WIDE_TILE];
#endif
DD_HIDDEN int dd_prefetch_blocks = 0;
/* 3: with OpenMP's barriers (0.55 us a crossing) the int8 model's forward after 256 tokens took
 * 0.95-0.97x as long over 8-32 tokens with the rows rounded once (two threads), 0.99x over 6 and
 * 1.02-1.06x over 1-4, where the extra barriers cost more than the rounding saved; with dd_sync's
 * (0.1 us) sharing from 3 rows on instead of 8 took 0.96x over 3-6 tokens and 1.01x sharing from 2
 * (Intel Xeon family 6 model 207, after 200 tokens, in one process, medians of per-round ratios of
 * 40; the 8-lane passes 0.98x over 3-6) */
DD_HIDDEN int dd_share_rows = 3;

/* From `rows` rows on (0: never), the 8-bit-activation matmuls round their rows once, shared among the
 * threads, instead of each thread rounding every row (which needs no barrier); the same bits either
 * way. Returns nonzero for a negative value. */
int dd_set_share_rows(int rows) {
    if (rows < 0) return 1;
    dd_share_rows = rows;
    return 0;
}

/* The blocks ahead the AVX-512 passes of PREFETCH_ROWS rows or more prefetch (0: none, at most 256);
 * returns nonzero for a value out of range. */
int dd_set_prefetch(int blocks) {
    if (blocks < 0 || blocks > 256) return 1;
    dd_prefetch_blocks = blocks;
    return 0;
}

int dd_get_prefetch(void) {
    return dd_prefetch_blocks;
}

/* Groups per pass for tiles of `rows` rows of kind 0 (Q4_1), 1 (Q8_0), 2 (Q4_1_A8) or 3 (Q8_0_A8):
 * 0 (the 8-lane passes), 1, 2, 3 (rows <= 4) or 4 (rows <= 2); returns nonzero for a combination
 * without a pass, or when this build has no AVX-512 passes for the kind (then only 0 is taken). */
int dd_set_wide_groups(int kind, int rows, int groups) {
    /* the most rows a pass of 0 .. 4 groups takes, with fp32 activations and with 8-bit ones (whose
     * 8 x 3 integer sums fit the 32 registers beside three groups' levels and a broadcast) */
    static const int most[2][5] = {{WIDE_TILE, WIDE_TILE, WIDE_TILE, 4, 2}, {WIDE_TILE, WIDE_TILE, WIDE_TILE, WIDE_TILE, 2}};
    if (kind < 0 || kind > 3 || rows < 1 || rows > WIDE_TILE || groups < 0 || groups > 4 || rows > most[kind >= 2][groups]) return 1;
    if (groups && !(kind < 2 ? DD_WIDE : DD_WIDE_A8)) return 1;
    dd_wide_groups[kind][rows - 1] = (int8_t)groups;
    return 0;
}

/* The groups per pass set for tiles of `rows` rows of kind 0 .. 3 (-1 for rows out of range). */
int dd_get_wide_groups(int kind, int rows) {
    if (kind < 0 || kind > 3 || rows < 1 || rows > WIDE_TILE) return -1;
    return dd_wide_groups[kind][rows - 1];
}

/* Which AVX-512 passes this build has: 0 none, 1 those with fp32 activations (DD_WIDE), 2 also
 * those with 8-bit activations (DD_WIDE_A8). */
int dd_wide(void) {
    return DD_WIDE + DD_WIDE_A8;
}

int dd_set_attention(int mode) {
    if (mode < 0 || mode > 2) return 1;
    attention_mode = mode;
    return 0;
}

/* attention_shared on 16 lanes (1, where the build has AVX-512F) or 8 (0), unchanged for -1;
 * returns the setting in force. */
int dd_set_attention_wide(int on) {
    if (on >= 0) attention_wide = DD_WIDE && on;
    return attention_wide;
}

/* Floats of scratch one layer needs for n new tokens over T keys. */
/* dst[0..D) <- src rounded to the nearest fp16 (ties to even), the same bits in every lane and in
 * the scalar tail. */
static void to_half(uint16_t *dst, const float *src, int64_t D) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d < D; d++) dst[d] = _cvtss_sh(src[d], _MM_FROUND_TO_NEAREST_INT);
}

/* A profiling build (-DDD_PROFILE, `python -m ddspec.bench.phases`) counts the cycles of each phase
 * of a decoder layer on thread 0, between the barriers that end them (so a phase's count includes
 * its wait for the slowest thread), summed over layers and calls until dd_phases() reads them. The
 * default build compiles PHASE to nothing. */
enum { DD_PHASES = 9 }; /* norm, q/k/v, RoPE and cache, attention, o, post norm, gate/up, SiLU, down */
#ifdef DD_PROFILE
#include <x86intrin.h>
static double dd_phase_cycles[DD_PHASES];
static uint64_t dd_phase_mark;
#define PHASE_START() do { if (omp_get_thread_num() == 0) dd_phase_mark = __rdtsc(); } while (0)
#define PHASE(k) do { if (omp_get_thread_num() == 0) { const uint64_t now_ = __rdtsc(); \
        dd_phase_cycles[k] += (double)(now_ - dd_phase_mark); dd_phase_mark = now_; } } while (0)
/* Copies the phases' cycle counts into out[0 .. DD_PHASES) and zeroes them; returns DD_PHASES. */
int dd_phases(double *out) {
    for (int i = 0; i < DD_PHASES; i++) out[i] = dd_phase_cycles[i], dd_phase_cycles[i] = 0.0;
    return DD_PHASES;
}
/* The time-stamp counter, to convert the counts to seconds. */
uint64_t dd_cycles(void) {
    return __rdtsc();
}
#else
#define PHASE_START() ((void)0)
#define PHASE(k) ((void)0)
#endif

static int64_t layer_scratch(const dd_layer *L, int64_t n, int64_t T) {
    const int64_t nq = L->heads * L->head_dim, wqkv = nq + 2 * L->kv_heads * L->head_dim;
    return n * (L->hidden + L->extra) + n * wqkv + n * nq + n * 3 * L->inter + n * L->heads * T + n * L->heads;
}

/* 0 when layer L can run n new tokens after `start` cached ones (tmax slots), else 1 (a size out
 * of range) or 3 (it reads extra inputs and none were given). */
static int layer_check(const dd_layer *L, int64_t n, int64_t tmax, int64_t start, const float *extra) {
    const int64_t H = L->hidden, D = L->head_dim, E = L->extra;
    const int64_t wqkv = (L->heads + 2 * L->kv_heads) * D;
    if (D > 512 || start + n > tmax || L->qkv.out != wqkv || L->qkv.in != E + H || L->gate_up.out != 2 * L->inter) return 1;
    if (E > 0 && !extra) return 3;
    return 0;
}

/* One decoder layer over n new tokens, in place on the residual stream x [n, hidden], run by every
 * thread of the enclosing parallel region (dd_layers_forward's; layer_check passed), which ends
 * at a barrier. k/v caches: [kv_heads, tmax, head_dim] for this layer, fp32, or fp16 with kv_half
 * (each new key and value rounded to the nearest fp16 as it is written, before any row attends to
 * it); the new keys and values are written at slots [start, start + n). mask: [n, start + n] (1 =
 * attend) or NULL to attend to all of them. cos/sin: [max_position, head_dim]. buf: the scratch
 * (layer_scratch floats), shared by the threads. */
static void layer_forward_buf(const dd_layer *L, float *x, int64_t n, const int64_t *pos, const float *cos_t,
                              const float *sin_t, void *kc, void *vc, int64_t tmax, int64_t start,
                              const uint8_t *mask, int causal, const float *extra, float *buf, int kv_half) {
    const int64_t H = L->hidden, nh = L->heads, nkv = L->kv_heads, D = L->head_dim, I = L->inter, E = L->extra;
    const int64_t nq = nh * D, nk = nkv * D, wqkv = nq + 2 * nk, T = start + n;
    float *h = buf, *qkv = h + n * (H + E), *attn = qkv + n * wqkv, *gu = attn + n * nq, *act = gu + n * 2 * I;
    float *scores_all = act + n * I;
    const float scale = 1.0f / sqrtf((float)D);
    PHASE_START();
    /* 1. input norm (after the row's extra inputs, if any), then q, k, v */
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) {
        float *hi = h + i * (H + E);
        if (E) memcpy(hi, extra + i * E, sizeof(float) * (size_t)E);
        if (L->in_norm) rms_norm_row(x + i * H, L->in_norm, H, L->eps, hi + E);
        else memcpy(hi + E, x + i * H, sizeof(float) * (size_t)H);
    }
    dd_sync();
    PHASE(0);
    gemm_shared(&L->qkv, h, n, qkv, wqkv, 0);
    PHASE(1);
    /* 2. RoPE on q and k; keys and values into the cache */
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < n * (nh + nkv); j++) {
        const int64_t i = j / (nh + nkv), head = j % (nh + nkv);
        float *v = qkv + i * wqkv + head * D;
        rope(v, cos_t + pos[i] * D, sin_t + pos[i] * D, D);
        if (head >= nh) {
            const int64_t g = head - nh;
            const float *val = qkv + i * wqkv + nq + nk + g * D;
            const int64_t slot = (g * tmax + start + i) * D;
            if (kv_half) {
                to_half((uint16_t *)kc + slot, v, D);
                to_half((uint16_t *)vc + slot, val, D);
            } else {
                memcpy((float *)kc + slot, v, sizeof(float) * (size_t)D);
                memcpy((float *)vc + slot, val, sizeof(float) * (size_t)D);
            }
        }
    }
    dd_sync();
    PHASE(2);
    /* 3. attention: one token's rows alone; several tokens share each kv head's reads */
    const int rows = attention_mode == 1 || (attention_mode == 0 && n == 1);
    if (kv_half && rows)
        attention_rows_f16(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, scores_all, attn);
    else if (kv_half)
        attention_shared_f16(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, scores_all, attn, causal);
    else if (rows)
        attention_rows_f32(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, scores_all, attn);
    else
        attention_shared_f32(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, scores_all, attn, causal);
    PHASE(3);
    /* 4. x += o(attn); 5. post norm; 6. gate and up; 7. silu(gate) * up; 8. x += down(...) */
    gemm_shared(&L->o, attn, n, x, H, 1);
    PHASE(4);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) rms_norm_row(x + i * H, L->post_norm, H, L->eps, h + i * H);
    dd_sync();
    PHASE(5);
    gemm_shared(&L->gate_up, h, n, gu, 2 * I, 0);
    PHASE(6);
    /* in units of 256 columns, so that one token's row is shared too (each column alone, and
     * the same columns take the 8-lane path as with whole rows: the same bits) */
    const int64_t chunks = (I + 255) / 256;
#pragma omp for schedule(static) nowait
    for (int64_t unit = 0; unit < n * chunks; unit++) {
        const int64_t i = unit / chunks, c0 = unit % chunks * 256, c1 = c0 + 256 < I ? c0 + 256 : I;
        const float *g = gu + i * 2 * I, *u = g + I;
        float *a = act + i * I;
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) {
            const __m256 gv = _mm256_loadu_ps(g + c);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(a + c, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                  _mm256_loadu_ps(u + c)));
        }
        for (; c < c1; c++) a[c] = (g[c] / (1.0f + exp1(-g[c]))) * u[c];
    }
    dd_sync();
    PHASE(7);
    gemm_shared(&L->down, act, n, x, H, 1);
    PHASE(8);
}

/* Whether mask [n, start + n] is the causal one: row i sees keys [0, start + i] and no other (a
 * prompt's, a chain's; the attention then skips the hidden keys, see attention_shared). */
static int is_causal(const uint8_t *mask, int64_t n, int64_t start) {
    if (!mask) return 0;
    const int64_t T = start + n;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = mask + i * T, *hidden = memchr(row, 0, (size_t)T);
        if ((hidden ? hidden - row : T) != start + i + 1) return 0;
        if (hidden && memchr(hidden, 1, (size_t)(T - (start + i + 1)))) return 0;
    }
    return 1;
}

/* Layers [0, count) of `layers` in order, in place on x (one layer_forward_buf each, all in one
 * parallel region: opening one took about 1.4 us per layer), layer i using the cache at
 * kc + i * layer_stride elements (and vc likewise): fp32, or fp16 with kv_half. One call per
 * forward instead of one per layer; every layer is checked (layer_check) before any runs; extra:
 * [n, extra] for the layers that read one (NULL when none does); capture: NULL, or count pointers, capture[i] (when not NULL) receiving a copy of x [n, H] as it enters
 * layer i (the residual streams a draft head reads); final_norm: NULL, or the weights [H] of an
 * RMSNorm (epsilon final_eps) applied to each row of x after the last layer, in place (a model's
 * final norm here rather than as a torch op afterwards: after a forward streamed the weights
 * through the caches, a first torch op measured 30-60 us instead of 4-13). Returns 0, or the
 * first nonzero code with the failing layer's index * 8 added. */
int dd_layers_forward(const dd_layer *layers, int64_t count, float *x, int64_t n, const int64_t *pos,
                      const float *cos_t, const float *sin_t, void *kc, void *vc, int64_t layer_stride,
                      int64_t tmax, int64_t start, const uint8_t *mask, int nthreads, const float *extra,
                      float *const *capture, const float *final_norm, float final_eps, int kv_half) {
    int64_t size = 0; /* one scratch buffer for all the layers */
    for (int64_t i = 0; i < count; i++) {
        const int rc = layer_check(layers + i, n, tmax, start, extra);
        if (rc) return rc + 8 * (int)i;
        const int64_t need = layer_scratch(layers + i, n, start + n);
        size = need > size ? need : size;
    }
    float *buf = malloc(sizeof(float) * (size_t)(size + 1));
    if (!buf) return 2;
    const int causal = is_causal(mask, n, start);
    dd_span spans[DD_MAX_SPANS] = {{0}};
    dd_bar bar = {0}, *team_bar = dd_bar_fits(nthreads) ? &bar : NULL;
#pragma omp parallel num_threads(nthreads)
    {
        team_enter(spans, team_bar);
        for (int64_t i = 0; i < count; i++) {
            /* x is only read until the layer's o matmul, after the q/k/v matmul's barrier, which
             * this thread crosses after the copy */
            if (capture && capture[i] && omp_get_thread_num() == 0)
                memcpy(capture[i], x, sizeof(float) * (size_t)(n * layers[i].hidden));
            const size_t at = (size_t)(i * layer_stride) * (kv_half ? sizeof(uint16_t) : sizeof(float));
            layer_forward_buf(layers + i, x, n, pos, cos_t, sin_t, (char *)kc + at, (char *)vc + at, tmax, start, mask,
                              causal, extra, buf, kv_half);
        }
        team_leave();
    }
    free(buf);
    if (final_norm && count > 0) {
        const int64_t H = layers[0].hidden;
        float *row = malloc(sizeof(float) * (size_t)H);
        if (!row) return 2;
        for (int64_t i = 0; i < n; i++) {
            rms_norm_row(x + i * H, final_norm, H, final_eps, row);
            memcpy(x + i * H, row, sizeof(float) * (size_t)H);
        }
        free(row);
    }
    return 0;
}
#endif /* DD_HAS(6) */
