/* The weight kinds' table, the matmul entry points (dd_gemm, dd_gemm_sweep) and the matmuls'
 * settings: work stealing, the AVX-512 passes' groups, prefetch, shared rounding of rows. */
#include "common.h"

/* kind -> its functions (see dd_kind_ops) */
DD_HIDDEN const dd_kind_ops dd_kinds[DD_KINDS] = {
    [DD_F32] = {"f32", dd_mm_f32, 0, 0},
    [DD_Q4_1] = {"q4_1", dd_mm_q4_1, BLOCK_BYTES(DD_Q4_1), 32},
    [DD_Q8_0] = {"q8_0", dd_mm_q8_0, BLOCK_BYTES(DD_Q8_0), 32},
    [DD_F16] = {"f16", dd_mm_f16, 0, 0},
    [DD_BF16] = {"bf16", dd_mm_bf16, 0, 0},
    [DD_Q4_1_A8] = {"q4_1a8", dd_mm_q4_1a8, BLOCK_BYTES(DD_Q4_1), 32},
    [DD_Q8_0_A8] = {"q8_0a8", dd_mm_q8_0a8, BLOCK_BYTES(DD_Q8_0), 32},
    [DD_Q4_K] = {"q4_k", dd_mm_q4_k, 288, 256},
    [DD_Q6_K] = {"q6_k", dd_mm_q6_k, 576, 256},
    [DD_Q4_K_A8] = {"q4_ka8", dd_mm_q4_ka8, 288, 256},
    [DD_Q6_K_A8] = {"q6_ka8", dd_mm_q6_ka8, 448, 256},
    [DD_Q5_1] = {"q5_1", dd_mm_q5_1, 576, 32},
    [DD_Q5_1_A8] = {"q5_1a8", dd_mm_q5_1a8, 448, 32},
    [DD_STACK] = {"stack", dd_mm_stack, 0, 0},
};

/* y [n, out] (+)= x [n, in] @ W^T; output groups are shared among the threads of the enclosing
 * parallel region (see dd_span; also correct when called outside one), which end with a barrier. */
DD_HIDDEN void dd_matmul(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    const dd_kind_ops *k = W->kind >= 0 && W->kind < DD_KINDS ? &dd_kinds[W->kind] : &dd_kinds[DD_F32];
    k->matmul(W, x, n, y, ldy, acc);
}

/* DD_STACK: each part into its own columns of y (each part's matmul ends with its barrier) */
DD_HIDDEN void dd_mm_stack(const dd_weight *W, const float *x, int64_t n, float *y, int64_t ldy, int acc) {
    for (int64_t i = 0, off = 0; i < W->nparts; off += W->parts[i].out, i++) dd_matmul(&W->parts[i], x, n, y + off, ldy, acc);
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

/* Whether the matmul entries refuse W: a block weight whose inputs are not whole blocks (of 32
 * inputs, 256 for the K kinds). */
static int partial_blocks(const dd_weight *W) {
    if (W->kind == DD_STACK) {
        for (int64_t i = 0; i < W->nparts; i++)
            if (partial_blocks(&W->parts[i])) return 1;
        return 0;
    }
    return W->kind >= 0 && W->kind < DD_KINDS && dd_kinds[W->kind].unit && W->in % dd_kinds[W->kind].unit;
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
        dd_matmul(W, x, n, y, W->out, 0);
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
        for (int64_t i = 0; i < count; i++) dd_matmul(W[i], x, n, y, W[i]->out, 0);
        team_leave();
    }
    return 0;
}

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
DD_HIDDEN int dd_prefetch_rows = 3;
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

/* The blocks ahead the quantised passes of dd_prefetch_rows rows or more prefetch (0: none, at most
 * 256); returns nonzero for a value out of range. */
int dd_set_prefetch(int blocks) {
    if (blocks < 0 || blocks > 256) return 1;
    dd_prefetch_blocks = blocks;
    return 0;
}

int dd_get_prefetch(void) {
    return dd_prefetch_blocks;
}

/* The fewest rows of a pass that prefetch (1 .. 64); returns nonzero for a value out of range. */
int dd_set_prefetch_rows(int rows) {
    if (rows < 1 || rows > 64) return 1;
    dd_prefetch_rows = rows;
    return 0;
}

int dd_get_prefetch_rows(void) {
    return dd_prefetch_rows;
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
