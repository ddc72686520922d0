/* ddspec's CPU kernels: small-row matmuls on GGUF-quantised or dense weights, and whole Llama
 * decoder layers in a single call. This header is what every file of them shares: the weight and
 * layer structs (mirrored by CWeight / CLayer in native/lib.py), the work-sharing spans and the
 * barrier of a parallel region, the small inline helpers, and the functions one file exports to
 * the others (hidden: the library's exported symbols are the dd_* entry points alone).
 *
 * The files (see docs/kernels.md): f32.c, half.c (f16 / bf16) and dense.h, their passes; q4_1.c,
 * q8_0.c and quant.h, the block kinds with fp32 activations, a8.h their 8-bit-activation passes
 * (each kind's in its own file); gemm.c, the kind -> functions table and the matmul entry points;
 * attention.c (attention.inc twice: fp32 and fp16 caches); layers.c, the decoder layers;
 * misc.c, the rest (top_logprobs, the benchmark's floors).
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
 * Built on first use by ddspec/native/build.py (cc -O3 -mavx2 -mfma -mf16c -fopenmp
 * -ffp-contract=off, plus -mavxvnni / -mavx512f, and -mgfni / -mavx512vbmi for the 16-lane
 * passes' unpacking, where the CPU has them: see DD_VNNI, DD_WIDE, levels16 and a8_levels16, which
 * change the instructions, never the results) and called through ctypes; nothing here
 * allocates memory the caller sees.
 */
#ifndef DD_COMMON_H
#define DD_COMMON_H

#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sched.h>

enum { DD_F32 = 0, DD_Q4_1 = 1, DD_Q8_0 = 2, DD_F16 = 3, DD_BF16 = 4, DD_Q4_1_A8 = 5, DD_Q8_0_A8 = 6,
       DD_Q4_K = 7, DD_Q6_K = 8, DD_Q4_K_A8 = 9, DD_Q6_K_A8 = 10, DD_Q5_1 = 11, DD_Q5_1_A8 = 12, DD_STACK = 13 };

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
 *   DD_Q4_K, DD_Q6_K (and their _A8 twins): GGUF's K types, super-blocks of 256 inputs whose
 *            scales are in d; DD_Q5_1 (_A8): 5-bit levels with an fp16 scale and minimum (kquant.h)
 * The kernel broadcasts x[r, k] and accumulates one FMA per k into each output's lane, in
 * order of k (per block for the quantised kinds, see levels_at): the sum an output gets depends neither on how many rows nor on how many
 * outputs share a pass (nor on the threads), so a row's result is the same bit for bit
 * whether it is computed alone or inside a tree. */
typedef struct dd_weight {
    int64_t kind, out, in;
    const float *w;
    const uint8_t *qs;
    const float *d, *m;
    const float *bias;   /* [out] or NULL */
    /* DD_STACK: weights of different kinds stacked along the outputs (q|k|v with a Q5_1 q and k and
     * a Q8_0 v), each multiplied by its own kind into its columns of y, one after the other */
    const struct dd_weight *parts;
    int64_t nparts;
} dd_weight;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    const float *in_norm;   /* [hidden] or NULL (EAGLE heads have no first norm) */
    const float *post_norm; /* [hidden] */
    dd_weight qkv, o, gate_up, down;
    int64_t extra; /* > 0: q/k/v read cat(extra[i], in_norm(x[i])), extra given per call [n, extra]
                    * (an EAGLE-3 midlayer: the normed embedding beside the normed hidden state) */
    /* what other families add (all zero / NULL for Llama, Mistral, Qwen2 and the heads):
     * q_norm / k_norm: [head_dim] RMSNorms of each q and k head before RoPE (Qwen3, Gemma 3);
     * attn_norm / mlp_norm: [hidden] RMSNorms of the attention's and the MLP's outputs before they
     * join the residual stream (Gemma 2 and 3; Gemma's (1 + w) is folded into every norm weight);
     * act: the gate's activation, 0 SiLU, 1 GELU (tanh approximation, Gemma);
     * scale: the attention's scale (0: 1 / sqrt(head_dim)); softcap: > 0, scores become
     * softcap * tanh(score / softcap) (Gemma 2); window: > 0, the layer attends through the local
     * mask (a sliding window: dd_layers_forward's local_mask); cos / sin: the layer's own RoPE tables
     * (Gemma 3's local layers), NULL for the call's. */
    const float *q_norm, *k_norm, *attn_norm, *mlp_norm;
    int64_t act;
    float scale, softcap;
    int64_t window;
    const float *cos, *sin;
} dd_layer;

#define TILE 6 /* rows per pass: 6 rows x 2 vectors = 12 accumulators of the 16 ymm registers */
#ifndef BUFFER_FROM
#define BUFFER_FROM 6 /* more rows than this: each block of weights is read (and rebuilt) once, into L1 */
#endif

#define DD_HIDDEN __attribute__((visibility("hidden")))
/* a static helper some files of the library use and others do not */
#define DD_UNUSED __attribute__((unused))

/* y [n, out] (+)= x [n, in] @ W^T for one kind inside a parallel region (output groups shared
 * among its threads, see dd_span; also correct outside one), ending with a barrier: one function
 * per kind, in the kind's file (f32.c, half.c, q4_1.c, q8_0.c) */
typedef void (*dd_matmul_fn)(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_f32(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_f16(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_bf16(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q4_1(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q8_0(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q4_1a8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q8_0a8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q4_k(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q6_k(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q4_ka8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q6_ka8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q5_1(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_q5_1a8(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);
DD_HIDDEN void dd_mm_stack(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);

/* The weight kinds' table (gemm.c, dd_kinds): adding a kind adds its file, one row there and its
 * dd_mm_ function above. block_bytes: one group's block of 32 inputs (0: a dense kind, any width);
 * unit: the inputs a row's width must be a multiple of (32, 256 for the K kinds; 0: any).
 * A kind with 16-lane passes also has a row of dd_wide_groups (wide_index below, a switch the
 * passes' compiler folds, their kind being a constant). */
typedef struct {
    const char *name;
    dd_matmul_fn matmul;
    int block_bytes;
    int unit;
} dd_kind_ops;
enum { DD_KINDS = 14 };
extern DD_HIDDEN const dd_kind_ops dd_kinds[DD_KINDS];
/* y (+)= x @ W^T for any kind, through dd_kinds (an unknown kind as fp32, as before the table) */
DD_HIDDEN void dd_matmul(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc);

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

/* sx[r * nb + b] = x[r, 32b] + ... + x[r, 32b + 31], in order. */
static DD_UNUSED void block_sums(const float *x, int64_t n, int64_t in, float *sx) {
    const int64_t nb = in / 32;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += x[r * in + b * 32 + k];
            sx[r * nb + b] = s;
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

/* Blocks ahead (0: none) that the quantised passes of dd_prefetch_rows rows or more (3 unless
 * measured otherwise) ask the L2 cache to fetch, besides the hardware's own prefetching: with
 * several rows a pass spends long enough on each block that the hardware's streams fall behind.
 * Measured on the AMD EPYC family 26 machine (the int8 target's forward after 256 tokens,
 * interleaved medians of 41): 24 blocks ahead made 4 / 8 / 16 tokens 0.92x / 0.85x / 0.87x as long
 * (fp32 activations: 0.90x / 0.81x / 0.79x), 1-2 rows no faster (1-4% slower); with the AVX-512
 * passes switched off (the 8-lane passes, as on an AVX2-only CPU) 0.96-0.98x / 0.83-0.85x /
 * 0.84-0.89x (fp32 0.96-0.99x / 0.85-0.89x / 0.93-0.96x; two runs). On an AVX2-only AMD EPYC
 * (family 25 model 1) with Qwen2.5-Coder-1.5B Q4_K_M, 24 blocks ahead from 2 rows on made its
 * forward over 2 / 3 / 4 tokens 0.92x / 0.94x / 0.93x as long as none (one process, interleaved
 * medians of 15). Python sets both from measurements on the machine at hand (native.choose_wide,
 * native.choose_prefetch_rows); the same bits whatever they are.
 */
extern DD_HIDDEN int dd_prefetch_blocks;
extern DD_HIDDEN int dd_prefetch_rows;
extern DD_HIDDEN int dd_share_rows; /* see a8_gemm and dd_set_share_rows */
#define PREFETCH_AHEAD(R, blk, bytes)                                                               \
    do {                                                                                            \
        if ((R) >= dd_prefetch_rows && dd_prefetch_blocks)                                          \
            for (int l_ = 0; l_ < (bytes); l_ += 64)                                                \
                _mm_prefetch((const char *)(blk) + dd_prefetch_blocks * (bytes) + l_, _MM_HINT_T1); \
    } while (0)

/* AVX-512 (where the build enables it: native/build.py adds -mavx512f on CPUs that have it):
 * the quantised kinds with fp32 activations, one 16-lane register per group of 16 outputs.
 * Each lane runs exactly the arithmetic of the 8-lane passes above (the same FMAs, in the same
 * order of k, the same block ends), so the results are the same bits; what changes is the work
 * around them: one conversion of a group's levels and one broadcast of x per 16 products instead
 * of per 8, so several rows share the 8 bytes of levels at half the instructions. A pass runs
 * R rows against G consecutive groups (R * G independent FMA chains). dd_wide_groups says, per
 * kind and tile size, which G (0: the 8-lane passes); Python sets it from measurements on the
 * machine at hand (native/tuning.py, choose_wide), since the best G differs between CPUs. */
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

/* One new token of a sequence for dd_attention_singles: its query heads q [nh, D] (RoPE done), this
 * layer's cache kc / vc [nkv, tmax, D] (fp32, or fp16 with kv_half), the T keys it attends to (its
 * own included), its mask [T] (1 = attend) or NULL, room for its scores [nh, T] and its output
 * [nh, D]. */
typedef struct {
    const float *q;
    const void *kc, *vc;
    int64_t tmax, T;
    const uint8_t *mask;
    float *scores, *out;
} dd_single;

/* The attention of one new token of each of `count` sequences in one pass over the units (sequence,
 * kv head), shared between the threads (spans) and ending at a barrier: each row the bits that
 * dd_attention gives it. dd_attention_singles_apply: whether dd_attention runs a single token's rows
 * this way (not when dd_set_attention forces the shared passes). */
DD_HIDDEN void dd_attention_singles(const dd_single *singles, int64_t count, int64_t nh, int64_t nkv, int64_t D,
                                    float scale, float softcap, int kv_half);
DD_HIDDEN int dd_attention_singles_apply(void);

/* The attention of n new tokens (attention.c): rows or shared passes, by dd_set_attention's mode
 * (0: rows for one token, shared for more), over an fp32 cache or, with kv_half, an fp16 one. */
DD_HIDDEN void dd_attention(const float *qkv, int64_t wqkv, int64_t n, int64_t nh, int64_t nkv, int64_t D,
                            void *kc, void *vc, int64_t tmax, int64_t T, const uint8_t *mask, float scale,
                            float softcap, float *scores, float *attn, int causal, int kv_half);

#endif /* DD_COMMON_H */
