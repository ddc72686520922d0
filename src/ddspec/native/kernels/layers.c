/* Whole decoder layers in one call (dd_layers_forward): norms, q/k/v, RoPE and the cache, attention,
 * o, post norm, gate/up, SiLU, down, in one parallel region with dd_sync between the phases. */
#include "common.h"

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

/* x [n, hidden] += in @ W^T, or with a norm (Gemma 2 and 3's norms of the attention's and the MLP's
 * outputs) x += norm(in @ W^T), the product going through tmp [n, hidden] (free scratch). */
static void add_output(const dd_layer *L, const dd_weight *W, const float *norm, const float *in, int64_t n, float *x,
                       float *tmp) {
    const int64_t H = L->hidden;
    if (!norm) {
        dd_matmul(W, in, n, x, H, 1);
        return;
    }
    dd_matmul(W, in, n, tmp, H, 0);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) {
        float *t = tmp + i * H, *xi = x + i * H;
        rms_norm_row(t, norm, H, L->eps, t);
        for (int64_t c = 0; c < H; c++) xi[c] += t[c];
    }
    dd_sync();
}

/* One sequence of a forward: its rows [row0, row0 + n) of x, its cache (kc / vc: layer 0's
 * [kv_heads, tmax, head_dim], layer i's `stride` elements further), the new keys and values written at
 * slots [start, start + n), its masks ([n, start + n], 1 = attend; NULL: every key) for the layers
 * without and with a window, and whether each is the causal one (is_causal). */
typedef struct {
    int64_t row0, n;
    char *kc, *vc;
    int64_t stride, tmax, start;
    const uint8_t *mask, *local_mask;
    int causal, local_causal;
} dd_seq;

/* floats of scratch for layer L over N rows of sequences whose largest n * (start + n + 1) is nt */
static int64_t layer_scratch(const dd_layer *L, int64_t N, int64_t nt) {
    const int64_t nq = L->heads * L->head_dim, wqkv = nq + 2 * L->kv_heads * L->head_dim;
    return N * (L->hidden + L->extra) + N * wqkv + N * nq + N * 3 * L->inter + nt * L->heads;
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

/* Layer `li` (L) over the n new tokens of nseq sequences, in place on the residual stream x [n, hidden],
 * run by every thread of the enclosing parallel region (dd_layers_forward's; layer_check passed),
 * which ends at a barrier. The matmuls run over all n rows at once (each weight read once for every
 * sequence); RoPE, the cache writes and the attention run per sequence (seqs; row_seq[i]: row i's).
 * Caches fp32, or fp16 with kv_half (each new key and value rounded to the nearest fp16 as it is
 * written, before any row attends to it). cos/sin: [max_position, head_dim]. buf: the scratch
 * (layer_scratch floats), shared by the threads. */
static void layer_forward_buf(const dd_layer *L, int64_t li, float *x, int64_t n, const int64_t *pos, const float *cos_t,
                              const float *sin_t, const dd_seq *seqs, int64_t nseq, const int64_t *row_seq,
                              const float *extra, float *buf, int kv_half) {
    const int64_t H = L->hidden, nh = L->heads, nkv = L->kv_heads, D = L->head_dim, I = L->inter, E = L->extra;
    const int64_t nq = nh * D, nk = nkv * D, wqkv = nq + 2 * nk;
    const size_t elt = kv_half ? sizeof(uint16_t) : sizeof(float);
    float *h = buf, *qkv = h + n * (H + E), *attn = qkv + n * wqkv, *gu = attn + n * nq, *act = gu + n * 2 * I;
    float *scores_all = act + n * I;
    const float scale = L->scale > 0.0f ? L->scale : 1.0f / sqrtf((float)D);
    if (L->cos) cos_t = L->cos, sin_t = L->sin;
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
    dd_matmul(&L->qkv, h, n, qkv, wqkv, 0);
    PHASE(1);
    /* 2. RoPE on q and k; keys and values into the cache */
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < n * (nh + nkv); j++) {
        const int64_t i = j / (nh + nkv), head = j % (nh + nkv);
        float *v = qkv + i * wqkv + head * D;
        const float *qk_norm = head < nh ? L->q_norm : L->k_norm;
        if (qk_norm) rms_norm_row(v, qk_norm, D, L->eps, v);
        rope(v, cos_t + pos[i] * D, sin_t + pos[i] * D, D);
        if (head >= nh) {
            const dd_seq *S = seqs + row_seq[i];
            void *kc = S->kc + (size_t)(li * S->stride) * elt, *vc = S->vc + (size_t)(li * S->stride) * elt;
            const int64_t g = head - nh;
            const float *val = qkv + i * wqkv + nq + nk + g * D;
            const int64_t slot = (g * S->tmax + S->start + i - S->row0) * D;
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
    /* 3. attention, each sequence over its own cache. Two or more sequences' single new tokens (their
     * decoding steps) in one pass over (sequence, kv head) units, shared between the threads
     * (dd_attention_singles: each kv head's keys and values read from memory once for its query
     * heads, one barrier for all of them); the others one sequence at a time: one token's rows
     * alone, several tokens sharing each kv head's reads (dd_attention) */
    const int local = L->window > 0; /* this layer attends through the sequences' windowed masks */
    int64_t singles = 0;
    if (nseq > 1 && dd_attention_singles_apply())
        for (int64_t s = 0; s < nseq; s++) singles += seqs[s].n == 1;
    if (singles > 1) {
        dd_single one[singles]; /* each thread its own copy: no barrier to share one */
        float *sc = scores_all;
        for (int64_t s = 0, u = 0; s < nseq; s++) {
            const dd_seq *S = seqs + s;
            if (S->n != 1) continue;
            one[u++] = (dd_single){qkv + S->row0 * wqkv, S->kc + (size_t)(li * S->stride) * elt,
                                   S->vc + (size_t)(li * S->stride) * elt, S->tmax, S->start + 1,
                                   local ? S->local_mask : S->mask, sc, attn + S->row0 * nq};
            sc += nh * (S->start + 1);
        }
        dd_attention_singles(one, singles, nh, nkv, D, scale, L->softcap, kv_half);
    }
    for (int64_t s = 0; s < nseq; s++) {
        const dd_seq *S = seqs + s;
        if (singles > 1 && S->n == 1) continue;
        dd_attention(qkv + S->row0 * wqkv, wqkv, S->n, nh, nkv, D, S->kc + (size_t)(li * S->stride) * elt,
                     S->vc + (size_t)(li * S->stride) * elt, S->tmax, S->start + S->n, local ? S->local_mask : S->mask,
                     scale, L->softcap, scores_all, attn + S->row0 * nq, local ? S->local_causal : S->causal, kv_half);
    }
    PHASE(3);
    /* 4. x += o(attn) (or its norm); 5. post norm; 6. gate and up; 7. act(gate) * up; 8. x += down(...) */
    add_output(L, &L->o, L->attn_norm, attn, n, x, h);
    PHASE(4);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) rms_norm_row(x + i * H, L->post_norm, H, L->eps, h + i * H);
    dd_sync();
    PHASE(5);
    dd_matmul(&L->gate_up, h, n, gu, 2 * I, 0);
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
        if (L->act == 1) { /* GELU, tanh approximation: 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (e^2u + 1) */
            for (; c + 8 <= c1; c += 8) {
                const __m256 gv = _mm256_loadu_ps(g + c), g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
                const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f),
                                                _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, gv));
                const __m256 th = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                _mm256_add_ps(exp8(u2), _mm256_set1_ps(1.0f))));
                _mm256_storeu_ps(a + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv),
                                                                    _mm256_add_ps(_mm256_set1_ps(1.0f), th)),
                                                      _mm256_loadu_ps(u + c)));
            }
            for (; c < c1; c++)
                a[c] = 0.5f * g[c] * (1.0f + tanhf(0.7978845608028654f * (g[c] + 0.044715f * g[c] * g[c] * g[c]))) * u[c];
            continue;
        }
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
    add_output(L, &L->down, L->mlp_norm, act, n, x, h);
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

/* Layers [0, count) over the rows of nseq sequences (seqs, in order of their rows, n in all), in place
 * on x: one layer_forward_buf per layer, all in one parallel region (opening one took about 1.4 us
 * per layer). Every layer is checked against every sequence (layer_check) before any runs. */
static int run_layers(const dd_layer *layers, int64_t count, float *x, int64_t n, const int64_t *pos,
                      const float *cos_t, const float *sin_t, dd_seq *seqs, int64_t nseq, int nthreads,
                      const float *extra, float *const *capture, const float *final_norm, float final_eps,
                      int kv_half) {
    int64_t size = 0, nt = 0, ones = 0; /* one scratch buffer for all the layers and sequences */
    for (int64_t s = 0; s < nseq; s++) {
        dd_seq *S = seqs + s;
        const int64_t t = S->n * (S->start + S->n + 1);
        nt = t > nt ? t : nt;
        if (S->n == 1) ones += S->start + 1; /* the single tokens' scores side by side (step 3) */
        S->causal = is_causal(S->mask, S->n, S->start);
        if (!S->local_mask) S->local_mask = S->mask; /* no key outside the windows */
        S->local_causal = S->local_mask == S->mask ? S->causal : is_causal(S->local_mask, S->n, S->start);
    }
    nt = ones > nt ? ones : nt;
    for (int64_t i = 0; i < count; i++) {
        for (int64_t s = 0; s < nseq; s++) {
            const int rc = layer_check(layers + i, seqs[s].n, seqs[s].tmax, seqs[s].start, extra);
            if (rc) return rc + 8 * (int)i;
        }
        const int64_t need = layer_scratch(layers + i, n, nt);
        size = need > size ? need : size;
    }
    float *buf = malloc(sizeof(float) * (size_t)(size + 1));
    int64_t *row_seq = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!buf || !row_seq) {
        free(buf);
        free(row_seq);
        return 2;
    }
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t i = 0; i < seqs[s].n; i++) row_seq[seqs[s].row0 + i] = s;
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
            layer_forward_buf(layers + i, i, x, n, pos, cos_t, sin_t, seqs, nseq, row_seq, extra, buf, kv_half);
        }
        team_leave();
    }
    free(buf);
    free(row_seq);
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

/* Layers [0, count) of `layers` in order, in place on x [n, H], for one sequence, layer i using the
 * cache at kc + i * layer_stride elements (and vc likewise): fp32, or fp16 with kv_half. One call per
 * forward instead of one per layer; extra:
 * [n, extra] for the layers that read one (NULL when none does); capture: NULL, or count pointers, capture[i] (when not NULL) receiving a copy of x [n, H] as it enters
 * layer i (the residual streams a draft head reads); final_norm: NULL, or the weights [H] of an
 * RMSNorm (epsilon final_eps) applied to each row of x after the last layer, in place (a model's
 * final norm here rather than as a torch op afterwards: after a forward streamed the weights
 * through the caches, a first torch op measured 30-60 us instead of 4-13). Returns 0, or the
 * first nonzero code with the failing layer's index * 8 added. local_mask: [n, start + n], the mask of the
 * layers with a window (sliding-window attention), NULL when it equals mask. */
int dd_layers_forward(const dd_layer *layers, int64_t count, float *x, int64_t n, const int64_t *pos,
                      const float *cos_t, const float *sin_t, void *kc, void *vc, int64_t layer_stride,
                      int64_t tmax, int64_t start, const uint8_t *mask, int nthreads, const float *extra,
                      float *const *capture, const float *final_norm, float final_eps, int kv_half,
                      const uint8_t *local_mask) {
    dd_seq seq = {0, n, kc, vc, layer_stride, tmax, start, mask, local_mask, 0, 0};
    return run_layers(layers, count, x, n, pos, cos_t, sin_t, &seq, 1, nthreads, extra, capture, final_norm,
                      final_eps, kv_half);
}

/* The same over several sequences in one call (continuous batching): sequence s owns rows
 * [rows[s], rows[s + 1]) of x (n = rows[nseq]), its cache kcs[s] / vcs[s] (layer stride strides[s],
 * tmaxs[s] slots, starts[s] cached tokens) and its masks masks[s] / local_masks[s] (each may be
 * NULL). The matmuls read each weight once for all of them; a row's result is what the same
 * sequence gets alone (every sum runs in an order fixed by its own sizes). */
int dd_layers_forward_seqs(const dd_layer *layers, int64_t count, float *x, const int64_t *pos, const float *cos_t,
                           const float *sin_t, int64_t nseq, const int64_t *rows, void *const *kcs, void *const *vcs,
                           const int64_t *strides, const int64_t *tmaxs, const int64_t *starts,
                           const uint8_t *const *masks, const uint8_t *const *local_masks, int nthreads,
                           float *const *capture, const float *final_norm, float final_eps, int kv_half) {
    if (nseq < 1) return 1;
    dd_seq *seqs = calloc((size_t)nseq, sizeof(dd_seq));
    if (!seqs) return 2;
    for (int64_t s = 0; s < nseq; s++)
        seqs[s] = (dd_seq){rows[s], rows[s + 1] - rows[s], kcs[s], vcs[s], strides[s], tmaxs[s], starts[s], masks[s],
                           local_masks ? local_masks[s] : NULL, 0, 0};
    const int rc = run_layers(layers, count, x, rows[nseq], pos, cos_t, sin_t, seqs, nseq, nthreads, NULL, capture,
                              final_norm, final_eps, kv_half);
    free(seqs);
    return rc;
}
