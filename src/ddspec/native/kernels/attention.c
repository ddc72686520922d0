/* The attention of the new tokens over the cache: attention.inc's passes for fp32 and fp16 caches,
 * the softmax they share, and the choice between them (dd_attention). */
#include "common.h"


/* srow[0..T) <- e^(srow - max) (masked entries, mrow[t] == 0, give 0); returns 1 / their sum.
 * With a mask the visible entries are first moved together, in order, and moved back after:
 * the sum then runs over the same vector lanes as for a row that sees only those keys, so a
 * tree's row gets bit for bit what the same token gets decoded alone after its ancestors (the
 * values pass adds p = 0 for the hidden keys, which changes no sum). */
static float softmax_dense(float *srow, int64_t T);

/* s[t] <- cap * tanh(s[t] / cap) for the scores a mask leaves (-inf stays -inf): Gemma 2's
 * soft-capping of attention scores, before the softmax. */
static void cap_scores(float *s, int64_t T, float cap) {
    const float inv = 1.0f / cap;
    for (int64_t t = 0; t < T; t++)
        if (s[t] != -INFINITY) s[t] = cap * tanhf(s[t] * inv);
}

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

/* The attention passes (attention.inc, which undefines these parameters at its end) for a
 * cache of fp32 keys and values ... */
#define KVT float
#define KVN(name) name##_f32
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_ONE(p) (*(p))
#define KV_HALF 0
#include "attention.inc"
/* ... and of fp16 ones (kv_half in dd_layers_forward: the 8-bit-activation model's cache) */
#define KVT uint16_t
#define KVN(name) name##_f16
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_ONE(p) _cvtsh_ss(*(p))
#define KV_HALF 1
#include "attention.inc"

/* Which attention runs: 0 = by size (see dd_attention), 1 = attention_rows, 2 = attention_shared. */
static int attention_mode = 0;

DD_HIDDEN void dd_attention(const float *qkv, int64_t wqkv, int64_t n, int64_t nh, int64_t nkv, int64_t D,
                            void *kc, void *vc, int64_t tmax, int64_t T, const uint8_t *mask, float scale,
                            float softcap, float *scores_all, float *attn, int causal, int kv_half) {
    /* one token's rows alone; several tokens share each kv head's reads */
    const int rows = attention_mode == 1 || (attention_mode == 0 && n == 1);
    if (kv_half && rows)
        attention_rows_f16(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, softcap, scores_all, attn);
    else if (kv_half)
        attention_shared_f16(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, softcap, scores_all, attn, causal);
    else if (rows)
        attention_rows_f32(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, softcap, scores_all, attn);
    else
        attention_shared_f32(qkv, wqkv, n, nh, nkv, D, kc, vc, tmax, T, mask, scale, softcap, scores_all, attn, causal);
}

DD_HIDDEN void dd_attention_singles(const dd_single *singles, int64_t count, int64_t nh, int64_t nkv, int64_t D,
                                    float scale, float softcap, int kv_half) {
    const int64_t group = nh / nkv, units = count * nkv;
    span_start(units);
    for (int64_t u = -1; span_next(units, 1, &u) > 0;) {
        if (kv_half) single_unit_f16(singles + u / nkv, u % nkv, group, D, scale, softcap);
        else single_unit_f32(singles + u / nkv, u % nkv, group, D, scale, softcap);
    }
    dd_sync();
}
DD_HIDDEN int dd_attention_singles_apply(void) {
    return attention_mode != 2;
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
