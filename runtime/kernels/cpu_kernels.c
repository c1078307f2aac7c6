/* fp32 kernels for CPUs, where torch's small ops cost more in dispatch than in arithmetic.
 *
 * Built with -fopenmp: each parallelizes over rows or sequences with the thread count the
 * caller passes (torch's), and stays on one thread when the work is too small to share.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* RMSNorm of each row: out = x / sqrt(mean(x^2) + eps) * weight, as transformers computes it.
 * With a residual, the row is first added into it (in place) and the sum is normalized: one
 * pass instead of torch's six small ops. */
void ladle_rms_norm_row(const float *x, float *residual, const float *weight, float *out,
                        int32_t cols, float eps) {
    const float *src = x;
    if (residual != NULL) {
#pragma omp simd
        for (int d = 0; d < cols; d++) residual[d] += x[d];
        src = residual;
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int d = 0; d < cols; d++) squares += src[d] * src[d];
    const float inv = 1.0f / sqrtf(squares / (float)cols + eps);
#pragma omp simd
    for (int d = 0; d < cols; d++) out[d] = weight[d] * (src[d] * inv);
}

void ladle_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                        int64_t rows, int32_t cols, float eps, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++)
        ladle_rms_norm_row(x + r * cols, residual ? residual + r * cols : NULL, weight,
                           out + r * cols, cols, eps);
}

/* RoPE in rotate-half form, in place: each head's (x1, x2) halves become
 * (x1 cos - x2 sin, x2 cos + x1 sin), with the token's cos/sin rows [head_dim / 2]. q and k may
 * be rows of the QKV projection's output: their tokens are q_stride and k_stride floats apart. */
void ladle_rope_heads(float *x, int32_t heads, const float *c, const float *s,
                      int32_t head_dim) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *x1 = x + (int64_t)h * head_dim;
        float *x2 = x1 + half;
#pragma omp simd
        for (int d = 0; d < half; d++) {
            const float a = x1[d], b = x2[d];
            x1[d] = a * c[d] - b * s[d];
            x2[d] = b * c[d] + a * s[d];
        }
    }
}

void ladle_rope_f32(float *q, int32_t q_heads, int64_t q_stride, float *k, int32_t k_heads,
                    int64_t k_stride, const float *cos, const float *sin, int64_t tokens,
                    int32_t head_dim, int32_t num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        ladle_rope_heads(q + t * q_stride, q_heads, cos + t * half, sin + t * half, head_dim);
        ladle_rope_heads(k + t * k_stride, k_heads, cos + t * half, sin + t * half, head_dim);
    }
}

/* SiLU-and-mul of the fused gate/up projection: out = silu(x[:, :n]) * x[:, n:].
 *
 * libm's expf does not vectorize (without -ffast-math), so AVX2 machines use exp8: x = k ln2 + r
 * with |r| <= ln2 / 2, e^r from its Taylor series to degree 7, 2^k built in the exponent bits;
 * about 2 ulp, like torch's own vectorized exp. */
#ifdef __AVX2__
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(1.428606765330187e-06f)));
    static const float taylor[] = {1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f,
                                   4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(taylor[i]));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

void ladle_silu_and_mul_row(const float *gate, const float *up, float *o, int32_t n) {
    int d = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; d + 8 <= n; d += 8) {
        const __m256 g = _mm256_loadu_ps(gate + d);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + d, _mm256_mul_ps(silu, _mm256_loadu_ps(up + d)));
    }
#endif
    for (; d < n; d++) o[d] = gate[d] / (1.0f + expf(-gate[d])) * up[d];
}

void ladle_silu_and_mul_f32(const float *x, float *out, int64_t rows, int32_t n,
                            int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++)
        ladle_silu_and_mul_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n);
}

/* Write each token's keys and values (rows of num_kv_heads * head_dim floats, k_stride and
 * v_stride floats apart, as in the QKV output) into its cache slot. */
void ladle_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                        float *key_cache, float *value_cache, const int64_t *slots,
                        int64_t tokens, int32_t row) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        memcpy(key_cache + slot * row, k + t * k_stride, sizeof(float) * (size_t)row);
        memcpy(value_cache + slot * row, v + t * v_stride, sizeof(float) * (size_t)row);
    }
}

/* An fp16 cache (llama.cpp's default cache type) holds half fp32's bytes, and decode attention
 * is bound by reading them. Conversions round to nearest even: F16C or AVX-512 instructions
 * where the build has them, else _Float16's own. */
void ladle_f32_to_f16_row(const float *x, uint16_t *out, int32_t n) {
    int d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= n; d += 16)
        _mm256_storeu_si256((__m256i *)(out + d),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; d + 8 <= n; d += 8)
        _mm_storeu_si128((__m128i *)(out + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; d < n; d++) {
        const _Float16 h = (_Float16)x[d];
        memcpy(out + d, &h, sizeof h);
    }
}

static void f16_to_f32_row(const uint16_t *h, float *out, int32_t n) {
    int d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= n; d += 16)
        _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
#elif defined(__F16C__)
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
    for (; d < n; d++) {
        _Float16 x;
        memcpy(&x, h + d, sizeof x);
        out[d] = (float)x;
    }
}

void ladle_store_kv_f16(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                        uint16_t *key_cache, uint16_t *value_cache, const int64_t *slots,
                        int64_t tokens, int32_t row) {
    for (int64_t t = 0; t < tokens; t++) {
        ladle_f32_to_f16_row(k + t * k_stride, key_cache + slots[t] * row, row);
        ladle_f32_to_f16_row(v + t * v_stride, value_cache + slots[t] * row, row);
    }
}

/* ``n`` floats of a cache from element ``at``: the cache's own where it holds fp32, else
 * converted into ``buf``. */
static inline const float *cache_floats(const void *cache, int64_t at, int32_t n, int f16,
                                        float *buf) {
    if (!f16) return (const float *)cache + at;
    f16_to_f32_row((const uint16_t *)cache + at, buf, n);
    return buf;
}

/* Decode attention over the paged KV cache.
 *
 * One query token per sequence reads its keys and values straight from the cache blocks named
 * by its block table, so nothing is gathered into a contiguous copy first: on a CPU, decode
 * attention is bound by memory traffic, and the gather used to triple it.
 *
 * Layouts: q and out [num_seqs, num_heads, head_dim], q's rows q_stride floats apart (rows of
 * the QKV output), out contiguous; caches [num_blocks, block_size, num_kv_heads, head_dim];
 * block_tables [num_seqs, table_stride].
 */

#ifdef __AVX512F__
/* exp of 16 lanes, as exp8 above: about 2 ulp. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    static const float taylor[] = {1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f,
                                   4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, k);
}

/* Sixteen vectors to one whose lane j is the sum of a[j]'s lanes: a tree of adds over
 * transposing shuffles, about 3 instructions a vector where reducing each alone takes 10. */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 v[8], w[4];
    for (int i = 0; i < 8; i++) /* per 128 bits: (a0 + a2, b0 + b2, a1 + a3, b1 + b3) */
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128 bits: the sums of four vectors' quarters */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44),
                                    _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44),
                                    _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}
#endif

/* Each row of scores to exp(score - max), in place; returns 1 / the row's sum. */
static float softmax_row(float *row, int32_t len) {
    float max = -INFINITY;
    for (int t = 0; t < len; t++) max = row[t] > max ? row[t] : max;
    float sum = 0.0f;
    int t = 0;
#ifdef __AVX512F__
    __m512 sums = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(max)));
        _mm512_storeu_ps(row + t, e);
        sums = _mm512_add_ps(sums, e);
    }
    sum = _mm512_reduce_add_ps(sums);
#endif
    for (; t < len; t++) {
        row[t] = expf(row[t] - max);
        sum += row[t];
    }
    return 1.0f / sum;
}

#ifdef __AVX512F__
/* A sequence's cache rows in order: block and slot stepped rather than divided out per row. */
typedef struct {
    const int32_t *table;
    int32_t block_size, blk, off;
    int64_t block_stride, token_stride;
} row_walk;

static inline int64_t next_row(row_walk *w) {
    const int64_t at = (int64_t)w->table[w->blk] * w->block_stride + (int64_t)w->off * w->token_stride;
    if (++w->off == w->block_size) w->off = 0, w->blk++;
    return at;
}

/* Sixteen floats of a cache from element ``at``, widened from fp16 where it holds that. */
static inline __m512 load16(const void *cache, int64_t at, int f16) {
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at)));
    return _mm512_loadu_ps((const float *)cache + at);
}

/* The AVX-512 walk, for head_dim a multiple of 16 up to 128: the cache's rows are visited in
 * order, with their addresses stepped block by block rather than divided out per row.
 * Scores: per sixteen tokens, every head's sixteen dot products, reduced together while the
 * rows are in L1. Values: per group of query heads sharing a KV head, their outputs in
 * registers (up to 16 vectors) over every token, each value row read once per group. Inlined
 * per cache type, so that ``f16`` is a constant. */
static inline __attribute__((always_inline)) void attention_avx512(
    const float *qs, float *os, const void *key_cache, const void *value_cache,
    const int32_t *table, int32_t len, int32_t h0, int32_t h1, int32_t group, int32_t head_dim,
    int32_t block_size, int64_t block_stride, int64_t token_stride, float scale, float *scores,
    float *inv_sum, int f16) {
    const int nv = head_dim / 16;
    const row_walk start = {table, block_size, 0, 0, block_stride, token_stride};
    row_walk keys = start;
    for (int t = 0; t < len; t += 16) {
        const int n = len - t < 16 ? len - t : 16;
        int64_t rows[16];
        for (int j = 0; j < n; j++) rows[j] = next_row(&keys);
        for (int head = h0; head < h1; head++) {
            const float *qh = qs + (int64_t)head * head_dim;
            const int64_t kv = (int64_t)(head / group) * head_dim;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) {
                if (j >= n) {
                    acc[j] = _mm512_setzero_ps();
                    continue;
                }
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(key_cache, rows[j] + kv, f16));
                for (int c = 1; c < nv; c++)
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c),
                                        load16(key_cache, rows[j] + kv + 16 * c, f16), a);
                acc[j] = a;
            }
            const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + (int64_t)(head - h0) * len + t,
                                  (__mmask16)((1u << n) - 1), s);
        }
    }
    for (int i = 0; i < h1 - h0; i++) inv_sum[i] = softmax_row(scores + (size_t)i * len, len);
    const int per = 16 / nv; /* query heads whose outputs fit the registers at once */
    for (int first = h0; first < h1;) {
        int last = first + per < h1 ? first + per : h1;
        const int kv_head = first / group;
        if (last > (kv_head + 1) * group) last = (kv_head + 1) * group;
        const int count = last - first;
        const int64_t kv = (int64_t)kv_head * head_dim;
        __m512 acc[16];
        for (int i = 0; i < count * nv; i++) acc[i] = _mm512_setzero_ps();
        row_walk values = start;
        for (int t = 0; t < len; t++) {
            const int64_t v = next_row(&values) + kv;
            __m512 rowv[8];
            for (int c = 0; c < nv; c++) rowv[c] = load16(value_cache, v + 16 * c, f16);
            for (int g = 0; g < count; g++) {
                const __m512 p = _mm512_set1_ps(scores[(int64_t)(first + g - h0) * len + t]);
                for (int c = 0; c < nv; c++)
                    acc[g * nv + c] = _mm512_fmadd_ps(p, rowv[c], acc[g * nv + c]);
            }
        }
        for (int g = 0; g < count; g++) {
            const __m512 inv = _mm512_set1_ps(inv_sum[first + g - h0]);
            for (int c = 0; c < nv; c++)
                _mm512_storeu_ps(os + (int64_t)(first + g) * head_dim + 16 * c,
                                 _mm512_mul_ps(acc[g * nv + c], inv));
        }
        first = last;
    }
}
#endif

static inline __attribute__((always_inline)) int decode_heads(
    const float *qs, float *os, const void *key_cache, const void *value_cache,
    const int32_t *table, int32_t len, int32_t h0, int32_t h1, int32_t group,
    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, int f16) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    const int heads = h1 - h0;
    /* scores[(head - h0) * len + t], one normalizer per query head, then an fp16 cache's
     * KV heads of one row, widened (the heads' KV heads are at most as many as the heads) */
    float *scores = malloc(sizeof(float) * (size_t)heads * ((size_t)len + 1 + (size_t)head_dim));
    if (scores == NULL) return 1;
    float *inv_sum = scores + (size_t)heads * len;
    float *wide = inv_sum + heads;
#ifdef __AVX512F__
    if (head_dim % 16 == 0 && head_dim <= 128) {
        attention_avx512(qs, os, key_cache, value_cache, table, len, h0, h1, group, head_dim,
                         block_size, block_stride, token_stride, scale, scores, inv_sum, f16);
        free(scores);
        return 0;
    }
#endif
    /* The KV heads [kv0, kv1) that query heads [h0, h1) read, as one span of a row. */
    const int kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;
    const int32_t span = (kv1 - kv0) * head_dim;
    for (int t = 0; t < len; t++) {
        const int64_t at = (int64_t)table[t / block_size] * block_stride +
                           (int64_t)(t % block_size) * token_stride + (int64_t)kv0 * head_dim;
        const float *k = cache_floats(key_cache, at, span, f16, wide);
        for (int head = h0; head < h1; head++) {
            const float *qh = qs + (int64_t)head * head_dim;
            const float *kh = k + (int64_t)(head / group - kv0) * head_dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < head_dim; d++) acc += qh[d] * kh[d];
            scores[(head - h0) * len + t] = acc * scale;
        }
    }
    for (int i = 0; i < heads; i++) inv_sum[i] = softmax_row(scores + (size_t)i * len, len);
    for (int64_t i = (int64_t)h0 * head_dim; i < (int64_t)h1 * head_dim; i++) os[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const int64_t at = (int64_t)table[t / block_size] * block_stride +
                           (int64_t)(t % block_size) * token_stride + (int64_t)kv0 * head_dim;
        const float *v = cache_floats(value_cache, at, span, f16, wide);
        for (int head = h0; head < h1; head++) {
            const float p = scores[(head - h0) * len + t] * inv_sum[head - h0];
            const float *vh = v + (int64_t)(head / group - kv0) * head_dim;
            float *oh = os + (int64_t)head * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) oh[d] += p * vh[d];
        }
    }
    free(scores);
    return 0;
}

int ladle_decode_attention_f32_heads(const float *qs, float *os, const float *key_cache,
                                     const float *value_cache, const int32_t *table, int32_t len,
                                     int32_t h0, int32_t h1, int32_t group, int32_t num_kv_heads,
                                     int32_t head_dim, int32_t block_size, float scale) {
    return decode_heads(qs, os, key_cache, value_cache, table, len, h0, h1, group, num_kv_heads,
                        head_dim, block_size, scale, 0);
}

int ladle_decode_attention_f16_heads(const float *qs, float *os, const uint16_t *key_cache,
                                     const uint16_t *value_cache, const int32_t *table,
                                     int32_t len, int32_t h0, int32_t h1, int32_t group,
                                     int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                     float scale) {
    return decode_heads(qs, os, key_cache, value_cache, table, len, h0, h1, group, num_kv_heads,
                        head_dim, block_size, scale, 1);
}

static int paged_decode(const float *q, int64_t q_stride, const void *key_cache,
                        const void *value_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens, float *out,
                        int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,
                        int32_t head_dim, int32_t block_size, float scale, int32_t num_threads,
                        int f16) {
    int failed = 0;
    /* One sequence per task: its blocks are read front to back, every head of a token at once,
     * which keeps the reads sequential within each block. A single sequence stays on this
     * thread: waking the team costs more than its share of the work. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_seqs > 1)
    for (int s = 0; s < num_seqs; s++) {
        const float *qs = q + (int64_t)s * q_stride;
        float *os = out + (int64_t)s * num_heads * head_dim;
        const int32_t *table = block_tables + s * table_stride;
        const int group = num_heads / num_kv_heads;
        /* Two calls with constant cache types, not one with ``f16``: the parallel loop's body
         * is outlined before inlining, so there ``f16`` would be a variable, and a branch in
         * every load of the AVX-512 walk. */
        const int bad =
            f16 ? decode_heads(qs, os, key_cache, value_cache, table, seq_lens[s], 0, num_heads,
                               group, num_kv_heads, head_dim, block_size, scale, 1)
                : decode_heads(qs, os, key_cache, value_cache, table, seq_lens[s], 0, num_heads,
                               group, num_kv_heads, head_dim, block_size, scale, 0);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}

int ladle_paged_decode_attention_f32(
    const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
    int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
    int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(q, q_stride, key_cache, value_cache, block_tables, table_stride, seq_lens,
                        out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                        num_threads, 0);
}

int ladle_paged_decode_attention_f16(
    const float *q, int64_t q_stride, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
    int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
    int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(q, q_stride, key_cache, value_cache, block_tables, table_stride, seq_lens,
                        out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                        num_threads, 1);
}

/* Prefill attention over the paged cache, for chunks of any length (varlen): each sequence's new
 * tokens attend, causally, to its whole context (prefix-cache hits and earlier chunks included),
 * read straight from the cache blocks the KV store has just written. One call covers every
 * prefill chunk of a step, where the torch path made one SDPA call (and one gather of the
 * context) per sequence.
 *
 * The work is split into (sequence, KV head, tile of query rows) tasks. A tile's query heads
 * that share a KV head read each key and value row once: scores for the whole tile first, then
 * softmax per row (AVX2 exp where there is one), then the weighted values.
 *
 * Layouts: q and out start at the first prefill token; q's rows are q_stride floats apart, out
 * is contiguous [tokens, num_heads, head_dim]; query_start [num_seqs + 1] offsets the sequences'
 * rows from there; seq_lens count each sequence's context including its new tokens. */
#define PREFILL_TILE 16

static float exp_sum_in_place(float *x, int n, float max) {
    float sum = 0.0f;
    int t = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(max);
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), m));
        _mm256_storeu_ps(x + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < n; t++) {
        x[t] = expf(x[t] - max);
        sum += x[t];
    }
    return sum;
}

static int paged_prefill(const float *q, int64_t q_stride, const void *key_cache,
                         const void *value_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *seq_lens,
                         const int32_t *query_start, float *out, int32_t num_seqs,
                         int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                         int32_t block_size, float scale, int32_t num_threads, int f16) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    /* Tasks are numbered per sequence: tiles x KV heads, from a prefix sum. */
    int64_t *first_task = malloc(sizeof(int64_t) * ((size_t)num_seqs + 1));
    if (first_task == NULL) return 1;
    first_task[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        const int tiles = (q_len + PREFILL_TILE - 1) / PREFILL_TILE;
        first_task[s + 1] = first_task[s] + (int64_t)tiles * num_kv_heads;
    }
    const int64_t num_tasks = first_task[num_seqs];
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_tasks; task++) {
        int s = 0;
        while (first_task[s + 1] <= task) s++;
        const int64_t local = task - first_task[s];
        const int kv_head = (int)(local % num_kv_heads);
        const int tile = (int)(local / num_kv_heads);
        const int q_len = query_start[s + 1] - query_start[s];
        const int first_pos = seq_lens[s] - q_len; /* absolute position of the chunk's row 0 */
        const int row0 = tile * PREFILL_TILE;
        const int rows = q_len - row0 < PREFILL_TILE ? q_len - row0 : PREFILL_TILE;
        const int num_keys = first_pos + row0 + rows; /* the tile's last row sees these */
        const int32_t *table = block_tables + (int64_t)s * table_stride;
        const int vectors = rows * group;
        /* scores[(r * group + g) * num_keys + t], one normalizer per query vector, then an
         * fp16 cache's row, widened */
        float *scores =
            malloc(sizeof(float) * ((size_t)vectors * ((size_t)num_keys + 1) + (size_t)head_dim));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *inv_sum = scores + (size_t)vectors * num_keys;
        float *wide = inv_sum + vectors;
        const int64_t token0 = query_start[s] + row0;

        for (int t = 0; t < num_keys; t++) {
            const int64_t at = (int64_t)table[t / block_size] * block_stride +
                               (int64_t)(t % block_size) * token_stride +
                               (int64_t)kv_head * head_dim;
            const float *k = cache_floats(key_cache, at, head_dim, f16, wide);
            /* Row r (position first_pos + row0 + r) sees key t when t <= its position. */
            const int r_first = t - first_pos - row0 > 0 ? t - first_pos - row0 : 0;
            for (int r = r_first; r < rows; r++) {
                for (int g = 0; g < group; g++) {
                    const float *qv = q + (token0 + r) * q_stride +
                                      (int64_t)(kv_head * group + g) * head_dim;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int d = 0; d < head_dim; d++) acc += qv[d] * k[d];
                    scores[(size_t)(r * group + g) * num_keys + t] = acc * scale;
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            const int len = first_pos + row0 + r + 1;
            for (int g = 0; g < group; g++) {
                float *row = scores + (size_t)(r * group + g) * num_keys;
                float max = -INFINITY;
                for (int t = 0; t < len; t++) max = row[t] > max ? row[t] : max;
                inv_sum[r * group + g] = 1.0f / exp_sum_in_place(row, len, max);
                float *o = out + ((token0 + r) * num_heads + kv_head * group + g) * head_dim;
                for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
            }
        }
        for (int t = 0; t < num_keys; t++) {
            const int64_t at = (int64_t)table[t / block_size] * block_stride +
                               (int64_t)(t % block_size) * token_stride +
                               (int64_t)kv_head * head_dim;
            const float *v = cache_floats(value_cache, at, head_dim, f16, wide);
            const int r_first = t - first_pos - row0 > 0 ? t - first_pos - row0 : 0;
            for (int r = r_first; r < rows; r++) {
                for (int g = 0; g < group; g++) {
                    const float p =
                        scores[(size_t)(r * group + g) * num_keys + t] * inv_sum[r * group + g];
                    float *o = out + ((token0 + r) * num_heads + kv_head * group + g) * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
                }
            }
        }
        free(scores);
    }
    free(first_task);
    return failed;
}

int ladle_paged_prefill_attention_f32(
    const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
    const int32_t *query_start, float *out, int32_t num_seqs, int32_t num_heads,
    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
    int32_t num_threads) {
    return paged_prefill(q, q_stride, key_cache, value_cache, block_tables, table_stride,
                         seq_lens, query_start, out, num_seqs, num_heads, num_kv_heads, head_dim,
                         block_size, scale, num_threads, 0);
}

int ladle_paged_prefill_attention_f16(
    const float *q, int64_t q_stride, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
    const int32_t *query_start, float *out, int32_t num_seqs, int32_t num_heads,
    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
    int32_t num_threads) {
    return paged_prefill(q, q_stride, key_cache, value_cache, block_tables, table_stride,
                         seq_lens, query_start, out, num_seqs, num_heads, num_kv_heads, head_dim,
                         block_size, scale, num_threads, 1);
}
